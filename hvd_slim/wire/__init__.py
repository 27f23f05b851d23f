"""Wire: payload layout (values, core indices as Elias-Fano or bitmap, dense fallback) and strict
decoding; no network. ``indices``/``message`` work on numpy arrays; ``indices_torch`` and
``message_torch`` write and read the same bytes as tensors on any device (a GPU's messages are
built and decoded there). Both index codecs are ``index_codec`` over a numpy or a torch kernel;
``views`` holds a tensor's bytes and reads them back."""
from .errors import WireError
from .indices import (IDX_BITMAP, IDX_EF, decode_indices, encode_indices, encoded_size,
                      index_bytes_bound)
from .message import RemoteError

__all__ = ["WireError", "RemoteError", "IDX_EF", "IDX_BITMAP", "encode_indices",
           "decode_indices", "encoded_size", "index_bytes_bound"]
