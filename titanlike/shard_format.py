"""The token-shard file format (described in titanlike/data.py), in a module without torch, so that
titanlike-prepare starts in a fraction of a second and its workers stay light."""

import struct

MAGIC = b"TLSHARD\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes/token, count, max token id
assert HEADER.size == 32
