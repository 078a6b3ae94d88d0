"""A loopback TCP relay that can be cut: a partition between some clients and one server.

Clients that connect to ``relay.port`` (127.0.0.1) reach ``target``. ``cut()`` is a
partition as a client sees it: bytes stop flowing both ways (calls time out, new
connections are accepted and then hear nothing), nothing is refused or reset. ``heal()``
closes every connection made so far, so clients reconnect and traffic flows again. For
partitions of many in-process clients at once, where network namespaces per client would
be thousands of processes.
"""

from __future__ import annotations

import selectors
import socket
import threading


class Relay:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        self._cut = True

    def heal(self) -> None:
        with self._lock:
            socks = list(self._pairs)
            self._pairs.clear()
            for s in socks:
                self._drop(s)
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self._thread.join(2)
        self.heal()
        self._listener.close()

    def _drop(self, s: socket.socket) -> None:
        try:
            self._sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()

    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select(0.1):
                sock = key.fileobj
                with self._lock:
                    if sock is self._listener:
                        client, _ = self._listener.accept()
                        try:
                            upstream = socket.create_connection(self.target, timeout=2)
                        except OSError:
                            client.close()
                            continue
                        for s in (client, upstream):
                            s.setblocking(False)
                            self._sel.register(s, selectors.EVENT_READ, None)
                        self._pairs[client], self._pairs[upstream] = upstream, client
                        continue
                    peer = self._pairs.get(sock)
                    if peer is None:
                        continue
                    try:
                        data = sock.recv(1 << 16)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        for s in (sock, peer):
                            self._pairs.pop(s, None)
                            self._drop(s)
                        continue
                    if self._cut:
                        continue  # a partition drops what is sent
                    try:
                        peer.setblocking(True)
                        peer.settimeout(2)
                        peer.sendall(data)
                        peer.setblocking(False)
                    except OSError:
                        for s in (sock, peer):
                            self._pairs.pop(s, None)
                            self._drop(s)
