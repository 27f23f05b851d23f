"""Scripts a user copies: Horovod-style, with the one changed import line visible."""
