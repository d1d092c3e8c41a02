"""TLS on the router's OpenAI HTTP front (--http-tls-cert, --http-tls-key, and with
--http-tls-client-ca, client certificates required), in process over one scripted
engine (tests/unit/router/inprocess.py), with certificates made at test time
(tests/certs.py); and the files refused at startup, as the gRPC ones are."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from omnibus.router.cli import main
from omnibus.router.http.app import OpenAIFront
from tests.certs import Pair, Pki, make_pki
from tests.grpc_helpers import free_port
from tests.unit.router.inprocess import Router

TENANTS = {"t": {"keys": ["sk-t"]}}
BODY = {"model": "m", "prompt": "w1 w2", "max_tokens": 2}
AUTH = {"Authorization": "Bearer sk-t"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def https_front(tmp_path, **tls: str) -> tuple[Router, OpenAIFront, int]:
    port = free_port()
    router = await Router(tmp_path, TENANTS, http_port=port, **tls).start()
    front = OpenAIFront(router.pipeline, router.config, None)
    await front.start()
    return router, front, port


def completion(url: str, verify: ssl.SSLContext | bool) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, verify=verify, timeout=10)


def trusting(pki: Pki, cert: Pair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(str(cert.cert), str(cert.key))
    return context


async def test_https_serves_a_completion_and_plaintext_is_refused(pki, tmp_path):
    router, front, port = await https_front(tmp_path, http_tls_cert=str(pki.server.cert),
                                            http_tls_key=str(pki.server.key))
    try:
        reply = await _off_loop(completion, f"https://127.0.0.1:{port}", trusting(pki))
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2
        health = await _off_loop(lambda: httpx.get(f"https://localhost:{port}/health",
                                                   verify=trusting(pki), timeout=10))
        assert health.status_code == 200  # the certificate names localhost too
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await _off_loop(completion, f"https://127.0.0.1:{port}", ssl.create_default_context())
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # HTTP to a TLS port
            await _off_loop(completion, f"http://127.0.0.1:{port}", False)
    finally:
        await front.stop()
        await router.close()


async def test_a_client_ca_requires_a_certificate_it_signed(pki, tmp_path):
    router, front, port = await https_front(
        tmp_path, http_tls_cert=str(pki.server.cert), http_tls_key=str(pki.server.key),
        http_tls_client_ca=str(pki.ca))
    url = f"https://127.0.0.1:{port}"
    try:
        reply = await _off_loop(completion, url, trusting(pki, pki.client))
        assert reply.status_code == 200, reply.text
        for who, context in {"no certificate": trusting(pki),
                             "a certificate of another CA": trusting(pki, pki.wrong_client)}.items():
            # TLS 1.3: the server refuses the certificate after the client's handshake ends,
            # so the client sees it as an alert on its first read, or a dropped connection.
            with pytest.raises((httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)):
                reply = await _off_loop(completion, url, context)
                pytest.fail(f"{who}: answered {reply.status_code}")
    finally:
        await front.stop()
        await router.close()


def test_bad_http_tls_files_are_refused_at_startup(pki, tmp_path, capsys):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a pem\n")
    cert, key = str(pki.server.cert), str(pki.server.key)
    missing = tmp_path / "missing.crt"
    refused = {
        (f"--http-tls-cert={missing}", f"--http-tls-key={key}"):
            f"HTTP front (--http-tls-*): cannot read TLS certificate {missing}: No such file or directory",
        (f"--http-tls-cert={cert}", f"--http-tls-key={pki.client.key}"):
            f"HTTP front (--http-tls-*): TLS key {pki.client.key} is not the key of the certificate in {cert}",
        (f"--http-tls-cert={cert}",):
            "HTTP front (--http-tls-*): a TLS certificate needs its key and a key its certificate",
        (f"--http-tls-cert={cert}", f"--http-tls-key={key}", f"--http-tls-client-ca={garbage}"):
            f"HTTP front (--http-tls-*): client CA {garbage} does not hold valid PEM certificates",
        (f"--http-tls-client-ca={pki.ca}",):
            "HTTP front (--http-tls-*): requiring client certificates (mutual TLS) needs the "
            "server's own certificate and key",
    }  # fmt: skip
    for flags, message in refused.items():
        code = main(["serve", "--engine", "127.0.0.1:1", "--model", str(tmp_path), "--http-port", "8000",
                     *flags])
        assert (code, capsys.readouterr().err) == (2, f"error: {message}\n"), flags
    code = main(["serve", "--engine", "127.0.0.1:1", "--model", str(tmp_path), f"--http-tls-cert={cert}",
                 f"--http-tls-key={key}"])
    assert (code, capsys.readouterr().err) == (2, "error: --http-tls-cert, --http-tls-key and "
                                                  "--http-tls-client-ca need the HTTP front: set --http-port\n")


async def _off_loop(call, *args):
    """A blocking client call, off the event loop that serves it."""
    return await asyncio.to_thread(call, *args)
