"""--ssl-certfile / --ssl-keyfile: the server's site speaks HTTPS with the given certificate
(a self-signed one, made by the openssl command line), and its address says https."""

from __future__ import annotations

import asyncio
import re
import shutil
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from aioinfer.server.launch import make_site, server_address


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_the_server_speaks_https_with_the_certificate(engine, certificate):
    cert, key = certificate
    config = ServerConfig(host="127.0.0.1", port=0, ssl_certfile=str(cert), ssl_keyfile=str(key))
    runner = web.AppRunner(create_app(engine, config))
    await runner.setup()
    await make_site(runner, config).start()
    try:
        port = runner.addresses[0][1]
        trusted = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{port}/v1/models", ssl=trusted) as r:
                assert r.status == 200 and (await r.json())["data"]
            with pytest.raises(aiohttp.ClientError):  # plain HTTP is not served
                await session.get(f"http://127.0.0.1:{port}/v1/models")
    finally:
        await runner.cleanup()
    assert server_address(config).startswith("https://127.0.0.1:")


async def test_a_unix_socket_speaks_tls_too(engine, certificate, tmp_path):
    cert, key = certificate
    path = str(tmp_path / "tls.sock")
    config = ServerConfig(uds=path, ssl_certfile=str(cert), ssl_keyfile=str(key))
    runner = web.AppRunner(create_app(engine, config))
    await runner.setup()
    await make_site(runner, config).start()
    try:
        # A raw request: aiohttp's client does not speak TLS over a Unix socket.
        trusted = ssl.create_default_context(cafile=str(cert))
        trusted.check_hostname = False
        reader, writer = await asyncio.open_unix_connection(
            path, ssl=trusted, server_hostname="localhost"
        )
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        status_line = await reader.readline()
        writer.close()
        assert status_line.startswith(b"HTTP/1.1 200")
    finally:
        await runner.cleanup()


def test_an_encrypted_key_is_refused_with_what_to_do(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-days", "1", "-subj", "/CN=x",
         "-passout", "pass:secret", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    config = ServerConfig(ssl_certfile=str(cert), ssl_keyfile=str(key))
    with pytest.raises(SystemExit, match="encrypted"):
        make_site(web.AppRunner(web.Application()), config)


def test_a_key_without_a_certificate_or_a_bad_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ssl_keyfile needs ssl_certfile"):
        ServerConfig(ssl_keyfile="key.pem")
    runner = web.AppRunner(web.Application())
    missing = tmp_path / "missing.pem"
    with pytest.raises(
        SystemExit, match=f"Cannot load --ssl-certfile {re.escape(str(missing))}: no such file"
    ):
        make_site(runner, ServerConfig(ssl_certfile=str(missing)))
    # The file that is missing is named, whichever it is.
    present = tmp_path / "cert.pem"
    present.write_text("not a certificate")
    config = ServerConfig(ssl_certfile=str(present), ssl_keyfile=str(missing))
    with pytest.raises(
        SystemExit, match=f"Cannot load --ssl-keyfile {re.escape(str(missing))}: no such file"
    ):
        make_site(runner, config)
    with pytest.raises(
        SystemExit, match=f"Cannot load --ssl-certfile {re.escape(str(present))}: .*PEM"
    ):
        make_site(runner, ServerConfig(ssl_certfile=str(present)))
