"""Wire: payload layout (values, core indices as Elias-Fano or bitmap, dense fallback) and strict
decoding. Pure numpy; no network."""
from .errors import WireError
from .indices import (IDX_BITMAP, IDX_EF, decode_indices, encode_indices, encoded_size,
                      index_bytes_bound)
from .message import RemoteError

__all__ = ["WireError", "RemoteError", "IDX_EF", "IDX_BITMAP", "encode_indices",
           "decode_indices", "encoded_size", "index_bytes_bound"]
