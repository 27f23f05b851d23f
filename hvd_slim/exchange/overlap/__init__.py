"""Overlap with backward (``overlap=S``): the model cut into stages, each its own exchange
(staged.py), started on the communication thread (runner.py) in an order every rank agrees on
(order.py)."""
