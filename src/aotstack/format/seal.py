"""A package's seal: its manifest's SHA-256, and Ed25519 signatures of that digest.

The manifest records the hash of every other entry, so the seal covers the whole file: a file
damaged anywhere fails the seal or an entry's hash. The digest alone proves no origin (whoever
edits a file can recompute it); a signature by a key the loader trusts does. ``cryptography``
is imported only to make or check a signature.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PackageError, SignatureError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SEAL_FORMAT = "aotstack-seal"
ALGORITHM = "ed25519"
# What a key signs: the digest behind a fixed prefix, so the signature means this and nothing else.
SIGNED_PREFIX = b"aotstack package manifest sha256 "
# Where a loader finds the public keys it requires a signature from (paths, os.pathsep between).
TRUSTED_KEYS_VARIABLE = "AOTSTACK_TRUSTED_KEYS"
MAX_SIGNATURES = 16

TrustedKeys = Sequence["Ed25519PublicKey"]
# What ``load(public_key=...)`` takes: a key, a PEM file's path, PEM bytes, or a list of those.
PublicKeyLike = Any


@dataclass(frozen=True)
class Signature:
    key_id: str
    value: str


@dataclass(frozen=True)
class Seal:
    manifest_sha256: str
    signatures: list[Signature]


def seal_to_bytes(seal: Seal) -> bytes:
    signatures = [{"algorithm": ALGORITHM, "key_id": s.key_id, "signature": s.value} for s in seal.signatures]
    return json.dumps(
        {"format": SEAL_FORMAT, "manifest_sha256": seal.manifest_sha256, "signatures": signatures}, indent=1
    ).encode()


def seal_from_bytes(data: bytes) -> Seal:
    """The seal in ``data``, every field checked; ``PackageError`` naming the first bad one."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise PackageError(f"unreadable seal ({exc})") from None
    if not isinstance(value, dict) or value.get("format") != SEAL_FORMAT:
        raise PackageError("the seal is not an aotstack seal")
    digest = value.get("manifest_sha256")
    if not is_hex(digest, 64):
        raise PackageError("the seal's manifest_sha256 is not a SHA-256 in hex")
    signatures = value.get("signatures")
    if not isinstance(signatures, list) or len(signatures) > MAX_SIGNATURES:
        raise PackageError(f"the seal's signatures must be a list of at most {MAX_SIGNATURES}")
    return Seal(digest, [signature_from_json(item) for item in signatures])


def signature_from_json(value: Any) -> Signature:
    if (
        not isinstance(value, dict)
        or value.get("algorithm") != ALGORITHM
        or not is_hex(value.get("key_id"), 32)
        or not is_hex(value.get("signature"), 128)
    ):
        raise PackageError(f"a signature in the seal is not an {ALGORITHM} key id and signature in hex")
    return Signature(value["key_id"], value["signature"])


def is_hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


# Keys ----------------------------------------------------------------------------------------


def crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SignatureError("signing and verifying need the 'cryptography' package") from None
    return serialization, ed25519


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the start of the SHA-256 of its raw bytes."""
    serialization, _ = crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def new_key_pair() -> tuple[bytes, bytes]:
    """A new Ed25519 key pair as PEM: (private key, public key)."""
    serialization, ed25519 = crypto()
    private = ed25519.Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def private_key(value: str | os.PathLike[str] | bytes | Ed25519PrivateKey) -> Ed25519PrivateKey:
    """An Ed25519 private key from a key, PEM bytes or a PEM file's path."""
    serialization, ed25519 = crypto()
    if isinstance(value, ed25519.Ed25519PrivateKey):
        return value
    pem = key_bytes(value, "private key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{describe(value)} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SignatureError(f"{describe(value)} is a {type(key).__name__}; aotstack signs with Ed25519 keys")
    return key


def public_keys(value: PublicKeyLike) -> list[Ed25519PublicKey]:
    """Ed25519 public keys from a key, PEM bytes, a PEM file's path, or a list of those."""
    serialization, ed25519 = crypto()
    if isinstance(value, (list, tuple)):
        keys = [key for item in value for key in public_keys(item)]
        if not keys:
            raise SignatureError("an empty list of trusted public keys trusts nothing")
        return keys
    if isinstance(value, ed25519.Ed25519PublicKey):
        return [value]
    pem = key_bytes(value, "public key")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{describe(value)} is not a PEM public key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise SignatureError(f"{describe(value)} is a {type(key).__name__}; aotstack verifies Ed25519 keys")
    return [key]


def key_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value, "rb") as file:
                return file.read()
        except OSError as exc:
            raise SignatureError(f"cannot read the {what} {os.fspath(value)!r}: {exc.strerror}") from None
    raise SignatureError(f"a {what} must be a key, PEM bytes or a file's path, got {type(value).__name__}")


def describe(value: Any) -> str:
    return repr(os.fspath(value)) if isinstance(value, (str, os.PathLike)) else "the key given"


def keys_from_environment() -> list[Ed25519PublicKey] | None:
    """The public keys named by ``AOTSTACK_TRUSTED_KEYS``; None where it is unset or empty."""
    paths = [p for p in os.environ.get(TRUSTED_KEYS_VARIABLE, "").split(os.pathsep) if p]
    return public_keys(paths) if paths else None


# Signatures ----------------------------------------------------------------------------------


def signed(seal: Seal, key: Ed25519PrivateKey) -> Seal:
    """``seal`` with a signature by ``key`` added (replacing an earlier one by the same key)."""
    signer = key_id(key.public_key())
    value = key.sign(SIGNED_PREFIX + seal.manifest_sha256.encode()).hex()
    others = [s for s in seal.signatures if s.key_id != signer]
    if len(others) >= MAX_SIGNATURES:
        raise SignatureError(f"a package holds at most {MAX_SIGNATURES} signatures")
    return Seal(seal.manifest_sha256, [*others, Signature(signer, value)])


def verified_signer(seal: Seal, trusted: TrustedKeys, path: str) -> str:
    """The id of the trusted key that signed ``seal``; ``SignatureError`` where none did."""
    from cryptography.exceptions import InvalidSignature

    if not seal.signatures:
        raise SignatureError(f"{path} is not signed, and a signature by a trusted key is required")
    message = SIGNED_PREFIX + seal.manifest_sha256.encode()
    by_id = {key_id(key): key for key in trusted}
    known = [s for s in seal.signatures if s.key_id in by_id]
    if not known:
        ids = ", ".join(s.key_id for s in seal.signatures)
        raise SignatureError(f"{path} is signed by key(s) {ids}, none of which is trusted here")
    for signature in known:
        try:
            by_id[signature.key_id].verify(bytes.fromhex(signature.value), message)
        except InvalidSignature:
            continue
        return signature.key_id
    raise SignatureError(f"{path}: its signature by key {known[0].key_id} does not verify; the file was altered")
