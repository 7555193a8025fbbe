"""Key files and fingerprints: what people compare and what must stay private."""

from __future__ import annotations

import base64
import hashlib

import pytest

from campugrid.protocol import keys
from campugrid.protocol.errors import CampugridError, InvalidInput


def test_a_fingerprint_reads_like_openssh_and_names_the_raw_key():
    key = keys.Ed25519PrivateKey.generate()
    raw = keys.public_raw(key)
    expected = "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")
    assert keys.key_fingerprint(key) == keys.key_fingerprint(key.public_key()) == expected
    assert len(expected) == 7 + 43


def test_a_key_file_is_0600_from_the_start_and_loads_back(tmp_path):
    path = tmp_path / "sub" / "k.key"
    key, made = keys.load_or_create(path)
    assert made and path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "sub").stat().st_mode & 0o077 == 0
    again, made = keys.load_or_create(path)
    assert not made and keys.public_raw(again) == keys.public_raw(key)


def test_a_key_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "k.key"
    keys.write_private(path, keys.Ed25519PrivateKey.generate())
    path.chmod(0o640)
    with pytest.raises(CampugridError, match="readable by others"):
        keys.load_private(path)


@pytest.mark.parametrize(("text", "says"), [
    ("not base64!", "not base64"),
    (base64.b64encode(b"x" * 31).decode(), "32 bytes, not 31"),
    ("", "32 bytes, not 0"),
])
def test_a_bad_public_key_is_refused_with_what_is_wrong(text, says):
    with pytest.raises(InvalidInput, match=says):
        keys.parse_public(text)


def test_a_public_key_round_trips():
    key = keys.Ed25519PrivateKey.generate()
    assert keys.public_raw(keys.parse_public(keys.public_text(key))) == keys.public_raw(key)
