"""The batch directory (batch_store.py) and the parsing of input lines (batch_runner.py):
a torn results line is dropped, ids cannot reach outside the directory, one server per
directory, and every way a line can be wrong is named."""

from __future__ import annotations

import pytest

from pagellm.entrypoints.openai.batch_runner import LineError, parse_line
from pagellm.entrypoints.openai.batch_store import BatchStore, DirectoryLock, ResultsLog
from pagellm.entrypoints.openai.errors import APIError


def test_a_torn_last_result_is_dropped_and_cut_off(tmp_path):
    store = BatchStore(tmp_path)
    log = ResultsLog(store.results_path("batch_x"))
    log.append(1, True, {"custom_id": "a"})
    log.append(2, False, {"custom_id": "b"})
    log.close()
    with open(store.results_path("batch_x"), "a") as f:
        f.write('{"line": 3, "output": tr')  # a crash mid-write
    assert [r["line"] for r in store.read_results("batch_x")] == [1, 2]
    assert store.results_path("batch_x").read_text().endswith("}\n")  # appending goes on cleanly


def test_files_survive_a_new_store_and_ids_stay_inside(tmp_path):
    file = BatchStore(tmp_path).add_file(b'{"a": 1}\n', "in.jsonl", "batch")
    again = BatchStore(tmp_path)
    assert again.file(file.id) == file and again.file_path(file.id).read_bytes() == b'{"a": 1}\n'
    for bad in ("../../etc/passwd", "..", "file-x/../y", ""):
        with pytest.raises(APIError) as missing:
            again.file(bad)
        assert missing.value.status == 404
    (tmp_path / "files" / ".file-z.json.1234.tmp").write_text("half")
    BatchStore(tmp_path)
    assert not list((tmp_path / "files").glob("*.tmp"))  # an interrupted write is removed


def test_one_server_per_directory(tmp_path):
    lock = DirectoryLock(tmp_path)
    with pytest.raises(OSError):
        DirectoryLock(tmp_path)
    lock.release()
    DirectoryLock(tmp_path).release()


@pytest.mark.parametrize(
    "text,code",
    [
        ("nope", "invalid_json"),
        ("[1, 2]", "invalid_request"),
        ('{"method": "POST", "url": "/v1/completions", "body": {}}', "missing_custom_id"),
        ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_method"),
        ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}', "mismatched_url"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": "x"}', "invalid_request"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": {"stream": true}}', "invalid_request"),
    ],
)
def test_every_way_a_line_can_be_wrong_is_named(text, code):
    with pytest.raises(LineError) as error:
        parse_line(text, "/v1/completions")
    assert error.value.code == code


def test_a_good_line_and_run_batch_lines_of_any_endpoint():
    assert parse_line('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}', "/v1/completions") == (
        "a", {"prompt": "x"},
    )  # fmt: skip
    assert parse_line('{"custom_id": "b", "url": "/v1/embeddings", "body": {}}', None)[0] == "b"
    with pytest.raises(LineError) as error:
        parse_line('{"custom_id": "c", "url": "/v1/moderations", "body": {}}', None)
    assert error.value.code == "invalid_url"


def test_an_unusable_batch_directory_turns_the_api_off_and_says_why(tmp_path):
    from pagellm.entrypoints.openai.serving_batch import BatchServing

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    served = BatchServing(a_file, 1000)
    assert served.store is None and "cannot be used" in served.unavailable and str(a_file) in served.unavailable
    first = BatchServing(tmp_path / "dir", 1000)
    second = BatchServing(tmp_path / "dir", 1000)
    assert first.store is not None and "in use by another server" in second.unavailable
    with pytest.raises(APIError) as off:
        second.list_files(None, None, None, "desc")
    assert off.value.status == 503 and "in use" in str(off.value)


def test_a_file_expires_and_is_swept_unless_a_running_batch_reads_it(tmp_path):
    now = [1_000_000.0]
    store = BatchStore(tmp_path, clock=lambda: now[0])
    lasting = store.add_file(b"{}\n", "keep.jsonl", "batch")
    short = store.add_file(b"{}\n", "short.jsonl", "batch", lifetime_s=3600)
    read_by_a_batch = store.add_file(b"{}\n", "input.jsonl", "batch", lifetime_s=3600)
    assert short.expires_at == short.created_at + 3600 and lasting.expires_at is None
    now[0] += 3599
    assert store.file(short.id) == short and store.sweep_expired() == 0
    now[0] += 1  # its expires_at: gone for the API at once
    with pytest.raises(APIError) as gone:
        store.file(short.id)
    assert gone.value.status == 404 and "expired" in str(gone.value)
    assert {f.id for f in store.files()} == {lasting.id}
    assert store.sweep_expired(keep={read_by_a_batch.id}) == 1
    assert not (tmp_path / "files" / short.id).exists() and not (tmp_path / "files" / f"{short.id}.json").exists()
    # The running batch still reads its input; once it has ended the next sweep deletes it.
    assert store.file_path(read_by_a_batch.id, even_expired=True).read_bytes() == b"{}\n"
    assert store.sweep_expired() == 1 and not (tmp_path / "files" / read_by_a_batch.id).exists()
    assert store.file(lasting.id) == lasting
