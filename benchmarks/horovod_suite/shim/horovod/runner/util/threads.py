"""The thread helper the suite's test/utils/common.py imports."""
import threading
from typing import Any, Callable, Optional, Tuple


def in_thread(target: Callable[..., Any], args: Tuple[Any, ...] = (), name: Optional[str] = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a daemon thread and return the thread."""
    def body() -> None:
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise
    thread = threading.Thread(target=body, name=name, daemon=daemon)
    thread.start()
    return thread
