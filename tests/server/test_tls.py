"""--ssl-certfile / --ssl-keyfile: the server's site speaks HTTPS with the given certificate
(a self-signed one, made by the openssl command line), and its address says https."""

from __future__ import annotations

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


def test_a_key_without_a_certificate_or_a_bad_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ssl_keyfile needs ssl_certfile"):
        ServerConfig(ssl_keyfile="key.pem")
    config = ServerConfig(ssl_certfile=str(tmp_path / "missing.pem"))
    with pytest.raises(SystemExit, match="Cannot load --ssl-certfile"):
        make_site(web.AppRunner(web.Application()), config)
