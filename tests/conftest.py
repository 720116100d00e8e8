"""Fixtures: a tiny dataset made once per session by the real datagen, copied into each test's volume;
a tiny base model and SFT rows for the finetune tests, also made once; the fake RunPod API."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from finetune_support import make_base_model
from support import TINY_DATAGEN, run_trainpod
from vlm_support import OCR_FILE, VLM_BASE, make_tiny_vlm, write_ocr_jsonl


@pytest.fixture
def fake() -> Iterator:
    """The fake RunPod API on 127.0.0.1 (the mock of RunPod), which fails the test on any request RunPod's OpenAPI
    description refuses. Tests that also point the environment at it define their own. Imported here, not at the
    top: fake_runpod needs jsonschema, which the GPU machine's `pytest -m gpu` (bench/gpu_check.py) lacks."""
    from fake_runpod import FakeRunPodServer

    with FakeRunPodServer() as fake:
        yield fake
    assert not fake.violations, f"requests RunPod would refuse: {fake.violations}"


@pytest.fixture(scope="session")
def tiny_dataset_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    volume = tmp_path_factory.mktemp("dataset-volume")
    result = run_trainpod("run", "datagen", "--config", str(TINY_DATAGEN), volume=volume)
    assert result.returncode == 0, f"datagen for the test dataset failed:\n{result.stdout}\n{result.stderr}"
    return volume


@pytest.fixture
def volume(tmp_path: Path, tiny_dataset_volume: Path) -> Path:
    """A fresh volume holding the tiny dataset and tokenizer, nothing else."""
    root = tmp_path / "volume"
    root.mkdir()
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, root / folder)
    return root


@pytest.fixture(scope="session")
def finetune_base_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/base (a tiny Llama with the test tokenizer) and data/sft.jsonl; copy it before writing."""
    volume = tmp_path_factory.mktemp("finetune-base")
    make_base_model(volume)
    return volume


@pytest.fixture(scope="session")
def vlm_base_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/vlm (a tiny Qwen2-VL with its tokenizer and image processor) and 40 OCR rows with their
    56x56 images at data/ocr/; copy it before writing."""
    volume = tmp_path_factory.mktemp("vlm-base")
    make_tiny_vlm(volume / VLM_BASE)
    write_ocr_jsonl(volume / OCR_FILE, 40, seed=5)
    return volume


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3 server on 127.0.0.1 (moto's server mode), standing in for RunPod's S3-compatible API."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


class FaultyS3Proxy:
    """A proxy in front of a real S3 server (moto's) that breaks the next `faults` GETs of keys ending in
    `suffix`, as a flaky network or gateway does, and forwards everything else untouched. A fault:
    'drop' answers 200 and closes the connection midway through the body (a connection reset while
    receiving), '503' answers Service Unavailable."""

    def __init__(self, upstream: str):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        self.faults, self.suffix, self.kind, self.broken = 0, "", "drop", 0
        self.requests: list[tuple[str, str]] = []  # (method, path with its query) of each request, in order
        self.refuse_batch_delete = (
            False  # answer DeleteObjects (POST ?delete) 501 NotImplemented, as a gateway may
        )
        # hold_parts(): uploads of parts after the first wait here, so a test can act mid-upload on a busy machine
        self.parts_forwarded, self.parts_gate = 0, threading.Event()
        self.parts_gate.set()
        proxy = self
        host = urlsplit(upstream).netloc

        class Forward(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?", 1)[0]
                proxy.requests.append((self.command, self.path))
                if self.command == "POST" and proxy.refuse_batch_delete and self.path.endswith("?delete"):
                    return self._error(501, "NotImplemented")
                if self.command == "GET" and proxy.faults and proxy.suffix and path.endswith(proxy.suffix):
                    proxy.faults -= 1
                    proxy.broken += 1
                    return self._break()
                if self.command == "PUT" and "partNumber=" in self.path:
                    if proxy.parts_forwarded >= 1:
                        proxy.parts_gate.wait(timeout=60)
                    proxy.parts_forwarded += 1
                upstream_conn = http.client.HTTPConnection(host, timeout=30)
                upstream_conn.request(self.command, self.path, body, dict(self.headers))
                answer = upstream_conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "server",
                        "date",
                    ):
                        self.send_header(name, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))  # HEAD: the object's size
                self.end_headers()
                self.wfile.write(data)
                upstream_conn.close()

            def _error(self, status: int, code: str):
                error = f"<Error><Code>{code}</Code></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)

            def _break(self):
                if proxy.kind == "503":
                    return self._error(503, "ServiceUnavailable")
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b"{")
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward  # noqa: N815 - http.server's names

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold_parts(self) -> None:
        """Multipart uploads stop after their first part until release_parts() (or a minute)."""
        self.parts_forwarded = 0
        self.parts_gate.clear()

    def release_parts(self) -> None:
        self.parts_gate.set()

    def break_next(self, suffix: str, faults: int = 1, kind: str = "drop") -> None:
        self.suffix, self.faults, self.kind = suffix, faults, kind

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty_s3(s3_server) -> Iterator[FaultyS3Proxy]:
    proxy = FaultyS3Proxy(s3_server)
    yield proxy
    proxy.close()
