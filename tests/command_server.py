"""`free-transformer` without its start-up cost, for tests that run many commands (test_docs.py): a server
imports the package and torch once, then forks one child per command; the child takes the caller's stdin,
stdout and stderr (passed over a Unix socket), working directory, environment and arguments, runs the CLI
and sends back its exit status.

    python tests/command_server.py SOCKET     # serves until killed
    python -S tests/command_server.py --client SOCKET ARGS...   # what the `free-transformer` shim runs
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

LENGTH = struct.Struct("!Q")


def client(path: str, argv: list[str]) -> int:
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(path)
        payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(connection, [LENGTH.pack(len(payload))], [0, 1, 2])
        connection.sendall(payload)
        status = b""
        while chunk := connection.recv(64):
            status += chunk
    return int(status) if status else 1


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, LENGTH.size, 3)
    size, payload = LENGTH.unpack(header)[0], b""
    while len(payload) < size:
        payload += connection.recv(size - len(payload))
    return json.loads(payload), fds


def _child(connection: socket.socket, request: dict, fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # the caller's PYTHONPATH, as a new process would put it on sys.path (a plugin module beside the caller)
    sys.path[:0] = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
    from free_transformer.cli import main

    try:
        status = main(request["argv"])
    except SystemExit as exit:  # argparse's --help and errors
        status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    connection.sendall(str(status or 0).encode())


def serve(path: str) -> None:
    import torch  # noqa: F401 - imported once, before any fork

    import free_transformer.cli
    import free_transformer.commands.generate
    import free_transformer.train.trainer  # noqa: F401

    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(8)
        print("ready", flush=True)
        while True:
            connection, _ = server.accept()
            request, fds = _receive(connection)
            if os.fork() == 0:
                server.close()
                try:
                    _child(connection, request, fds)
                finally:
                    os._exit(0)
            connection.close()
            for fd in fds:
                os.close(fd)
            while True:  # reap finished children
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    serve(sys.argv[1])
