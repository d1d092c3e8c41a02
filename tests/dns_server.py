"""A DNS server on loopback whose A records a test sets: the resolver the router asks
when started with `--engine dns://127.0.0.1:PORT/NAME:PORT` (the gRPC naming syntax's
DNS authority). It answers A queries over UDP on a thread; unknown names get NXDOMAIN."""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsServer:
    def __init__(self) -> None:
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns-server", daemon=True)
        self._thread.start()

    def set(self, name: str, addresses: list[str]) -> None:
        """`name` now resolves to `addresses` (an empty list: no such name)."""
        with self._lock:
            self._records[name.rstrip(".") + "."] = list(addresses)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            self.queries += 1
            self._sock.sendto(self._answer(dns.message.from_wire(wire)).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        question = query.question[0]
        with self._lock:
            addresses = self._records.get(question.name.to_text(), [])
        if not addresses:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A:
            reply.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", addresses))
        return reply
