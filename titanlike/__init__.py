"""titanlike: a readable PyTorch-native pretraining stack for Llama models."""
