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


def test_s3_credentials_by_profile(tmp_path, monkeypatch):
    # A worker may reach the run's bucket and its inbox with two credentials.
    creds = tmp_path / "credentials"
    creds.write_text("[inbox]\naws_access_key_id = AKINBOX\naws_secret_access_key = s\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    s = open_store("s3://bucket/p", endpoint_url="http://127.0.0.1:9", profile="inbox")
    assert s.profile == "inbox"
    assert s.client._request_signer._credentials.access_key == "AKINBOX"
    sub = s.sub("inbox/")
    assert (sub.profile, sub.prefix, sub.client) == ("inbox", "p/inbox", s.client)
    from botocore.exceptions import ProfileNotFound

    with pytest.raises(ProfileNotFound):
        open_store("s3://bucket/p", profile="missing")
