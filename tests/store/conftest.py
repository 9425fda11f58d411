import pytest

from colonnade.store import LocalStore
from s3server import make_s3_store


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return seaweed


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store", max_put_bytes=16 << 20)
    request.getfixturevalue("s3_env")
    return make_s3_store(request.getfixturevalue("seaweed"), max_put_bytes=16 << 20)
