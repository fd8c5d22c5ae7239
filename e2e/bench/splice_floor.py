"""The throughput benchmark's floor: the passthrough's design with no routing work.

N uvicorn processes share one TCP port, each also serving the app on its own Unix socket.
A request whose `cookie` header hashes (crc32) to another process is written, as it came,
to that process's socket over a kept-alive link of `tether.routing.splice` and its reply
copied back; the rest are served where they landed. No claims, no session lookup, no
router on either side, no hop header: what is left is the cost of the design itself (a
second parse, a Unix round trip, the copies), which tether's figure is read against.

    python -m e2e.bench.splice_floor WORKERS RUNTIME_DIR   (prints `port N`, then serves)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tether.routing.splice import Link, Links

APP = "e2e.bench.throughput_app:app"


class _Spliced:
    def __init__(self, front: Any, links: Links, path: str, data: bytes) -> None:
        self.front = front
        self.links = links
        self.path = path
        self.data = data

    def reply(self, data: bytes, link: Link) -> None:
        self.front.transport.write(data)
        if link.complete:
            self.front.spliced = None
            self.links.put(link)

    def lost(self, link: Link) -> None:
        """As the passthrough does, a request whose kept link closed unanswered is sent
        again (else the benchmark would count a lost connection): on the next kept link,
        which may have closed too (uvicorn keeps its side 5 s, the pool 15), else a new one."""
        link.close()
        if link.reused and not link.got_bytes:
            other = self.links.get(self.path)
            if other is not None and other.send(self.data, self):
                return
        self.front.transport.abort()


def _front_class(index: int, paths: list[str]) -> type[HttpToolsProtocol]:
    links = Links()

    class Front(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.public = transport.get_extra_info("socket").family != socket.AF_UNIX
            self.spliced: _Spliced | None = None

        def data_received(self, data: bytes) -> None:
            if self.public and self.spliced is None and (
                self.cycle is None or self.cycle.response_complete
            ):
                at = data.find(b"\r\ncookie: ")
                if at >= 0:
                    target = zlib.crc32(data[at : data.find(b"\r\n", at + 2)]) % len(paths)
                    link = links.get(paths[target]) if target != index else None
                    if link is not None:
                        self.spliced = _Spliced(self, links, paths[target], data)
                        if link.send(data, self.spliced):
                            return
                        self.spliced = None
            super().data_received(data)

    return Front


def serve_one(index: int, count: int, fd: int, runtime_dir: str) -> None:
    paths = [os.path.join(runtime_dir, f"floor-{i}.sock") for i in range(count)]
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(paths[index])
    unix.listen(2048)
    config = uvicorn.Config(APP, http=_front_class(index, paths), access_log=False,
                            log_level="warning", loop="uvloop")
    uvicorn.Server(config).run(sockets=[socket.socket(fileno=fd), unix])


def run_processes(module: str, count: int, runtime_dir: str, names: str,
                  *extra: str) -> None:
    """Bind one TCP port, start `count` processes of `module` (each run as `one INDEX
    COUNT FD RUNTIME_DIR *EXTRA`) sharing it, print `port N` once each has bound its Unix
    socket (`names`, formatted with its index, in `runtime_dir`), and wait for them; a
    SIGTERM stops them."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(2048)
    port, fd = listener.getsockname()[1], listener.fileno()
    children = [
        subprocess.Popen([sys.executable, "-m", module, "one", str(i), str(count), str(fd),
                          runtime_dir, *extra], pass_fds=[fd])
        for i in range(count)
    ]
    listener.close()

    def stop(*_: Any) -> None:
        for child in children:
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    sockets = [os.path.join(runtime_dir, names.format(i)) for i in range(count)]
    while not all(os.path.exists(path) for path in sockets):
        if any(child.poll() is not None for child in children):
            stop()
            sys.exit(f"a process of {module} exited at start")
        time.sleep(0.05)
    time.sleep(0.5)  # (a socket is bound a moment before it listens)
    print(f"port {port}", flush=True)
    for child in children:
        child.wait()


def main() -> None:
    if sys.argv[1] == "one":
        serve_one(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    run_processes("e2e.bench.splice_floor", int(sys.argv[1]), sys.argv[2], "floor-{}.sock")


if __name__ == "__main__":
    main()
