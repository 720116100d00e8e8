"""The RunPod client against the fake API (the mock of RunPod): retries on 429/5xx only, with
exponential backoff (sleep injected, never slept), no retry on 4xx, timeouts, and the key never in
an error or a log line."""

from __future__ import annotations

import logging

import pytest

from trainpod.errors import ExitCode
from trainpod.runpod.client import (
    Pod,
    RunPodAuthError,
    RunPodClient,
    RunPodError,
    RunPodForbidden,
    RunPodUnavailable,
    api_key,
)

from fake_runpod import KEY, client_for


def test_429_and_5xx_are_retried_with_exponential_backoff(fake):
    sleeps: list[float] = []
    fake.fail_next(503, times=2)
    fake.fail_next(429)
    assert client_for(fake, sleeps).list_pods() == []
    assert len(fake.requests) == 4
    assert sleeps == [1.0, 2.0, 4.0], "backoff doubles from 1 s (jitter pinned at its top)"


def test_retry_after_is_honoured(fake):
    sleeps: list[float] = []
    fake.fail_next(429, retry_after="7")
    client_for(fake, sleeps).list_pods()
    assert sleeps == [7.0]


@pytest.mark.parametrize("retry_after", ["-5", "nan", "-inf"])
def test_a_negative_or_not_a_number_retry_after_is_our_own_backoff_not_a_crash(fake, retry_after):
    """A proxy's Retry-After of -5 or nan went to sleep(), which raises ValueError: a traceback instead of a retry."""
    sleeps: list[float] = []
    fake.fail_next(503, retry_after=retry_after)
    assert client_for(fake, sleeps).list_pods() == []
    assert sleeps == [1.0], "the own backoff (1 s), never a negative or nan wait"


def test_backoff_is_capped_and_jittered(fake):
    sleeps: list[float] = []
    fake.fail_next(500, times=4)
    client = RunPodClient(KEY, base_url=fake.url, sleep=sleeps.append, jitter=lambda: 0.0, max_backoff_s=3)
    client.list_pods()
    assert sleeps == [0.5, 1.0, 1.5, 1.5], "jitter takes up to half off; the cap holds"


def test_a_4xx_other_than_429_is_not_retried(fake):
    sleeps: list[float] = []
    fake.fail_next(400)
    with pytest.raises(RunPodError) as caught:
        client_for(fake, sleeps).create_template({"name": "x", "imageName": "y"})
    assert len(fake.requests) == 1 and sleeps == []
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "POST /templates (400)" in str(caught.value)


def test_persistent_5xx_ends_in_a_temporary_error_without_key_or_body(fake, caplog):
    fake.fail_next(502, times=5)
    with caplog.at_level(logging.DEBUG), pytest.raises(RunPodUnavailable) as caught:
        client_for(fake).list_pods(name="run-pretrain")
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.TEMPORARY
    assert "GET /pods answered 502, 5 attempts in a row" in message
    everything = message + caplog.text
    assert KEY not in everything, "the key reached an error or a log line"
    assert "forced by the test" not in everything, "a response body was echoed"
    assert caplog.text.count("retry") == 4


def test_a_rejected_key_is_a_clear_error_and_never_shown(fake, caplog, capsys):
    client = RunPodClient("fake-wrong-key-for-tests", base_url=fake.url, sleep=lambda s: None)
    with caplog.at_level(logging.DEBUG), pytest.raises(RunPodAuthError) as caught:
        client.list_pods()
    assert "RUNPOD_API_KEY rejected: RunPod answered 401 to GET /pods" in str(caught.value)
    assert len(fake.requests) == 1, "a 401 is not retried"
    seen = str(caught.value) + caplog.text + capsys.readouterr().out + repr(client)
    assert "WRONGKEY" not in seen


@pytest.mark.parametrize(
    ("answer", "refused_key"),
    [
        ({"title": "Forbidden", "status": 403, "detail": "no access to this pool"}, False),
        ({"error": "you do not have permission to use this network volume"}, False),
        ({"title": "Forbidden", "status": 403, "detail": "API key does not have write access"}, True),
        ({"message": "Forbidden"}, True),
        (None, True),
    ],
)
def test_a_403_about_what_was_asked_for_is_not_called_a_refused_key(fake, answer, refused_key):
    """v2's 403 "no access to this pool" read as "RUNPOD_API_KEY rejected ... create one with All permissions": the
    user replaced a key that worked. A 403 whose words name the key (or that has none) is still the key refused;
    any other says the key was accepted and names what to check, without RunPod's words (they may echo secrets)."""
    asked: list[str] = []
    fake.handle = lambda method, raw_path, headers, raw_body: (asked.append(raw_path), (403, answer, {}))[1]
    with pytest.raises(RunPodError) as caught:
        client_for(fake).list_pods()
    message = str(caught.value)
    if refused_key:
        assert isinstance(caught.value, RunPodAuthError) and "RUNPOD_API_KEY rejected" in message
    else:
        assert isinstance(caught.value, RunPodForbidden), (
            "ends deploy and supervise (exit 2) as a refused key does"
        )
        assert "RUNPOD_API_KEY rejected" not in message
        assert "the key was accepted" in message and "pod.gpu_types" in message, message
        assert "pool" not in message.split("(403)")[0] and "no access" not in message
    assert len(asked) == 1, "a 403 is not retried"


def test_a_slow_api_times_out_and_is_retried_then_reported(fake):
    fake.delay_s = 0.5
    sleeps: list[float] = []
    client = client_for(fake, sleeps, timeout_s=0.1, max_attempts=2)
    with pytest.raises(RunPodUnavailable, match=r"GET /pods timed out after 0.1 s, 2 attempts"):
        client.list_pods()
    assert sleeps == [1.0]


def test_a_missing_pod_is_none_not_an_error(fake):
    assert client_for(fake).get_pod("nope") is None


def test_a_key_with_a_line_end_works_and_one_broken_inside_is_a_clear_error_never_shown(fake):
    """A .env file written on Windows gives RUNPOD_API_KEY a trailing CR: http.client refused the
    header with a ValueError quoting it, and `trainpod stop` printed the key in a raw traceback."""
    from fake_runpod import api_env

    assert RunPodClient.from_env(api_env(fake) | {"RUNPOD_API_KEY": fake.key + "\r"}).list_pods() == []
    broken = api_env(fake) | {"RUNPOD_API_KEY": "fake-runpod-\nkey-for-tests"}
    with pytest.raises(RunPodAuthError, match="line break, a space or a control character") as caught:
        RunPodClient.from_env(broken).list_pods()
    assert "fake-runpod" not in str(caught.value) and "key-for-tests" not in str(caught.value)


def test_key_comes_from_the_environment_first(tmp_path):
    (tmp_path / ".runpod").mkdir()
    (tmp_path / ".runpod/config.toml").write_text('[default]\napi_key = "from-file"\n')
    assert api_key({"RUNPOD_API_KEY": "from-env"}, home=tmp_path) == "from-env"


@pytest.mark.parametrize(
    "text",
    [
        '[default]\napi_key = "fake-key-from-file"\n',
        'apikey = "fake-key-from-file"\napiurl = "https://api.runpod.io"\n',
    ],
)
def test_key_comes_from_the_runpod_clis_config_file(tmp_path, text):
    (tmp_path / ".runpod").mkdir()
    (tmp_path / ".runpod/config.toml").write_text(text)
    assert api_key({}, home=tmp_path) == "fake-key-from-file"


def test_no_key_anywhere_says_where_to_put_one(tmp_path):
    with pytest.raises(RunPodAuthError, match=r"RUNPOD_API_KEY is unset.*export RUNPOD_API_KEY"):
        api_key({}, home=tmp_path)


def test_a_dropped_connection_is_retried_like_a_5xx_not_raised_raw():
    """A connection closed before the answer (a proxy's reset) is RemoteDisconnected, which urllib does
    not wrap in URLError: it must be retried and end as RunPodUnavailable, or the supervisor crashes."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def drop() -> None:
        while True:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    sleeps: list[float] = []
    client = RunPodClient(KEY, base_url=f"http://127.0.0.1:{server.getsockname()[1]}/v1",
                          sleep=sleeps.append, jitter=lambda: 1.0, max_attempts=3)  # fmt: skip
    with pytest.raises(RunPodUnavailable, match="dropped the connection"):
        client.list_pods()
    assert sleeps == [1.0, 2.0]


def test_a_create_whose_answer_was_lost_is_not_sent_again(fake):
    """RunPod made the pod but the answer came after the timeout: sending POST /pods again would
    rent a second GPU pod of the same name."""
    import time

    handle = fake.handle

    def late(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "POST" and raw_path.endswith("/pods"):
            time.sleep(0.5)
        return answer

    fake.handle = late
    client = client_for(fake, timeout_s=0.2, max_attempts=3)
    with pytest.raises(RunPodUnavailable, match="not sent again"):
        client.create_pod(
            {"name": "tiny-pretrain", "imageName": "img", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"]}
        )
    time.sleep(0.6)
    assert len(fake.calls("POST", "/pods")) == 1 and len(fake.pods_named("tiny-pretrain")) == 1


def test_a_delete_whose_answer_was_lost_and_whose_retry_finds_it_gone_is_done(fake):
    """RunPod terminated the pod but the answer came after the timeout: the retried DELETE is answered 404, which
    was an error telling the user to terminate it in the console, though it is gone and bills nothing."""
    import time

    pod = client_for(fake).create_pod(
        {"name": "tiny-pretrain", "imageName": "img", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"]}
    )
    handle = fake.handle

    def late(method, raw_path, headers, raw_body):
        answer = handle(method, raw_path, headers, raw_body)
        if method == "DELETE" and len(fake.calls("DELETE")) == 1:
            time.sleep(0.5)
        return answer

    fake.handle = late
    client_for(fake, timeout_s=0.2, max_attempts=3).terminate_pod(pod.id)
    time.sleep(0.6)
    assert fake.pods_named("tiny-pretrain") == [] and len(fake.calls("DELETE")) == 2


def test_a_delete_of_a_pod_not_there_at_the_first_try_is_still_not_found(fake):
    with pytest.raises(RunPodError, match="404"):
        client_for(fake).terminate_pod("no-such-pod")


def test_a_create_refused_with_429_is_still_retried(fake):
    sleeps: list[float] = []
    fake.fail_next(429)
    client_for(fake, sleeps).create_template({"name": "x", "imageName": "y"})
    assert sleeps == [1.0] and len(fake.templates) == 1


@pytest.mark.parametrize(
    ("prices", "expected"),
    [
        ({"adjustedCostPerHr": 2.49, "costPerHr": 2.99}, 2.49),
        ({"adjustedCostPerHr": None, "costPerHr": 2.99}, 2.99),  # it was None: a supervisor counted $0/h
        ({"costPerHr": 2.99}, 2.99),
        ({}, None),
    ],
)
def test_a_pods_price_is_the_adjusted_one_else_the_listed_one(prices, expected):
    assert Pod.from_api({"id": "p1", **prices}).cost_per_hr == expected


def test_the_key_goes_to_runpod_alone_never_to_another_host_an_answer_redirects_to(fake):
    """urllib hands a redirect every header of the request: an answer naming another host (a proxy's, a CDN's
    for a log archive, an http:// downgrade) was sent RUNPOD_API_KEY, which rents GPUs on the account. A
    redirect within RunPod's own origin keeps it, so the call still works."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    elsewhere_saw: list[str | None] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            elsewhere_saw.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *_):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    handle, redirect_to = fake.handle, []

    def redirecting(method, raw_path, headers, raw_body):
        if raw_path.split("?")[0].endswith("/pods") and redirect_to:
            return 302, None, {"Location": redirect_to.pop()}
        return handle(method, raw_path, headers, raw_body)  # checks the key: 401 without it

    fake.handle = redirecting
    client = client_for(fake)
    try:
        redirect_to.append(fake.url + "/pods")
        assert client.list_pods() == [], "a redirect within RunPod's origin is followed with the key"
        redirect_to.append(f"http://127.0.0.1:{other.server_port}/pods")
        assert client.list_pods() == []
    finally:
        other.shutdown()
        other.server_close()
    assert elsewhere_saw == [None], "the other host was sent the API key"


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_create_redirected_is_refused_never_sent_on_as_a_list(fake, code):
    """urllib turns a POST answered 301/302/303 into a GET without its body: a create became GET /pods (a proxy's
    http->https redirect), read as a pod made or failing on a list. It is now a clear error, and no GET is sent;
    a 307/308 (which keeps the method) is the same clear error, never a create sent twice."""
    handle = fake.handle

    def redirecting(method, raw_path, headers, raw_body):
        if method == "POST" and raw_path.split("?")[0].endswith("/pods"):
            return code, None, {"Location": fake.url + "/pods"}
        return handle(method, raw_path, headers, raw_body)

    fake.handle = redirecting
    with pytest.raises(RunPodError, match=f"answered {code} redirecting.*TRAINPOD_RUNPOD_API_URL") as caught:
        client_for(fake).create_pod(
            {"name": "tiny-pretrain", "imageName": "img", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"]}
        )
    assert fake.calls("GET") == [], "the create was sent on as a GET"
    # A 307/308 keeps the method and body: saying it would become a GET (or "another request") was untrue of them.
    keeps_the_request = code in (307, 308)
    assert ("body and all" in str(caught.value)) is keeps_the_request, str(caught.value)
    assert ("GET without its body" in str(caught.value)) is not keeps_the_request, str(caught.value)


@pytest.mark.parametrize(("method", "code"), [("POST", 307), ("POST", 308), ("GET", 308), ("GET", 302)])
def test_a_redirect_not_followed_says_so_never_that_the_request_does_not_fit_runpods_api(fake, method, code):
    """A 3xx urllib does not follow (no Location: a proxy's or a wrong TRAINPOD_RUNPOD_API_URL's; a 308 on Python
    3.10, which knows no 308) reached the 4xx path: 'the request does not fit RunPod's API; check the deploy
    config's values', sending the user to a config that was fine. It now names the redirect and the URL settings."""
    handle, sent = fake.handle, []

    def redirecting_nowhere(m, raw_path, headers, raw_body):
        sent.append(m)
        if m == method and raw_path.split("?")[0].endswith("/pods"):
            return code, None, {}
        return handle(m, raw_path, headers, raw_body)

    fake.handle = redirecting_nowhere
    client = client_for(fake)
    with pytest.raises(RunPodError) as caught:
        if method == "POST":
            client.create_pod(
                {"name": "tiny-pretrain", "imageName": "img", "gpuTypeIds": ["NVIDIA H100 80GB HBM3"]}
            )
        else:
            client.list_pods()
    message = str(caught.value)
    assert f"answered {code}" in message and "redirect" in message and "TRAINPOD_RUNPOD_API_URL" in message, (
        message
    )
    assert "does not fit RunPod's API" not in message and caught.value.exit_code == ExitCode.BAD_INPUT
    assert sent == [method], "sent once, nothing sent on"
