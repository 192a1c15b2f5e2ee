"""Preloaded by ``test_restart_forkserver_ends_without_interpreter_teardown``: an object whose
finalizer writes ``$MRL_TEARDOWN_MARK`` when the interpreter tears its modules down."""

import os


class _Mark:
    def __del__(self, _open=os.open, _write=os.write, _close=os.close,
                path=os.environ["MRL_TEARDOWN_MARK"]) -> None:
        fd = _open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        _write(fd, b"torn down")
        _close(fd)


MARK = _Mark()
