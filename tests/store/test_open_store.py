import pytest

from colonnade.store import LocalStore, S3Store, open_store


def test_plain_and_file_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_store("runs/a"), LocalStore)
    assert open_store("runs/a").root == (tmp_path / "runs/a").resolve()
    s = open_store((tmp_path / "b").as_uri())
    assert isinstance(s, LocalStore) and s.root == (tmp_path / "b").resolve()


def test_s3_urls(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    s = open_store("s3://bucket/some/prefix/", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s, S3Store)
    assert (s.bucket, s.prefix, s.endpoint_url) == ("bucket", "some/prefix", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8")
    assert open_store("s3://bucket").endpoint_url == "http://127.0.0.1:8"
    assert open_store("s3://bucket").prefix == ""


@pytest.mark.parametrize("url", ["gs://b/p", "http://x/y", "s3://", "file://host/p"])
def test_bad_urls(url):
    with pytest.raises(ValueError, match=r"s3://|file|host"):
        open_store(url)
