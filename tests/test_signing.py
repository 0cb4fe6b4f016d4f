"""Signed and sealed packages: what runs is what was built, or nothing runs."""

from __future__ import annotations

import json

import pytest
import torch

import aotstack
from aotstack.cli import main
from aotstack.format.archive import MANIFEST_PATH
from tests import models, tamper
from tests.conftest import run_child


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    for name in ("release", "other"):
        assert main(["keygen", str(directory / name)]) == 0
    return directory


@pytest.fixture(scope="module")
def signed_path(lowered_package, keys, tmp_path_factory):
    """The linear model's AOTI package, signed with the release key."""
    path = tmp_path_factory.mktemp("signed") / "signed.pt2"
    path.write_bytes(lowered_package("linear")[1].read_bytes())
    assert main(["sign", str(path), "--key", str(keys / "release")]) == 0
    return path


def test_keygen_writes_a_private_key_only_its_owner_reads_and_refuses_to_overwrite(keys, capsys):
    assert (keys / "release").stat().st_mode & 0o777 == 0o600
    assert b"BEGIN PUBLIC KEY" in (keys / "release.pub").read_bytes()
    assert main(["keygen", str(keys / "release")]) == 1
    assert "exists" in capsys.readouterr().err


def test_a_signed_package_verifies_and_loads_under_its_key(signed_path, keys, capsys):
    assert main(["verify", str(signed_path), "--public-key", str(keys / "release.pub")]) == 0
    assert "intact, signed by trusted key" in capsys.readouterr().out
    x = models.example_inputs("linear")[0]
    loaded = aotstack.load(signed_path, public_key=keys / "release.pub")
    torch.testing.assert_close(loaded.forward(x), models.build("linear")(x))
    # Trusting several keys, one of which signed, is enough; so is an unsigned load without keys.
    aotstack.load(signed_path, public_key=[keys / "other.pub", (keys / "release.pub").read_bytes()])
    aotstack.load(signed_path)


def test_a_key_that_did_not_sign_is_refused(signed_path, keys, capsys):
    with pytest.raises(aotstack.SignatureError, match="none of which is trusted"):
        aotstack.load(signed_path, public_key=keys / "other.pub")
    assert main(["verify", str(signed_path), "--public-key", str(keys / "other.pub")]) == 1
    assert "none of which is trusted" in capsys.readouterr().err


def test_trusted_keys_from_the_environment_refuse_an_unsigned_file(lowered_package, signed_path, keys, monkeypatch):
    monkeypatch.setenv("AOTSTACK_TRUSTED_KEYS", str(keys / "release.pub"))
    with pytest.raises(aotstack.SignatureError, match="is not signed"):
        aotstack.load(lowered_package("linear")[1])
    aotstack.load(signed_path)


def test_signing_twice_with_one_key_keeps_one_signature_and_two_keys_keep_two(signed_path, keys, tmp_path):
    path = tmp_path / "twice.pt2"
    path.write_bytes(signed_path.read_bytes())
    aotstack.sign(path, keys / "release")
    aotstack.sign(path, keys / "other")
    seal = json.loads(tamper.entries(path)["extra/aotstack_seal.json"])
    assert len(seal["signatures"]) == 2
    assert aotstack.verify(path, keys / "other.pub") != aotstack.verify(path, keys / "release.pub")


def test_a_damaged_file_is_not_signed(signed_path, keys, tmp_path):
    damaged = tamper.manifest_edited(signed_path, tmp_path / "damaged.pt2", lambda m: m.update(torch_version="x"),
                                     reseal=False)
    before = damaged.read_bytes()
    with pytest.raises(aotstack.PackageError, match="does not match its seal"):
        aotstack.sign(damaged, keys / "release")
    assert damaged.read_bytes() == before


def test_saving_is_reproducible(lowered_package, tmp_path):
    lowered, path = lowered_package("linear")
    lowered.save(tmp_path / "again.pt2")
    assert (tmp_path / "again.pt2").read_bytes() == path.read_bytes()


# Each case is loaded in one fresh process, which then reads /proc/self/maps: a refused file must
# have mapped no shared library, and the good file, loaded last, must have (so the check can fail).
REFUSALS = """
import json, sys
import aotstack
from aotstack.backends.aoti import run as aoti_run

def mapped_libraries():
    with open("/proc/self/maps") as maps:
        # A library opened from sealed memory ("/memfd:aotstack-<key>.so (deleted)") or from a private folder.
        return sorted({line.split()[5] for line in maps if "/memfd:aotstack-" in line or "aotstack-libraries" in line})

cases, good, public = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
opened = []
real_open = aoti_run.open_runner
aoti_run.open_runner = lambda *args: opened.append(args) or real_open(*args)
results = {}
for label, path in cases.items():
    try:
        aotstack.load(path, public_key=public)
        results[label] = "loaded"
    except aotstack.AotstackError as exc:
        results[label] = type(exc).__name__ + ": " + str(exc)
results["libraries before the good load"] = mapped_libraries()
results["runners before the good load"] = len(opened)
loaded = aotstack.load(good, public_key=public)  # kept: a freed runner closes its library
results["libraries after the good load"] = mapped_libraries()
print(json.dumps(results))
"""


def test_tampered_and_unsigned_files_are_refused_before_any_library_is_opened(
    signed_path, lowered_package, keys, tmp_path
):
    contents = tamper.entries(signed_path)
    manifest = json.loads(contents[MANIFEST_PATH])
    [delegate] = manifest["methods"]["forward"]["delegates"]
    library = "data/aotstack/" + delegate["named_data"]["model.so"]

    changed_blob = dict(contents)
    data = bytearray(changed_blob[library])
    data[2000] ^= 1
    changed_blob[library] = bytes(data)

    def loosen(m):
        m["methods"]["forward"]["inputs"][0]["shape"] = [None, None]

    bad_signature = json.loads(contents["extra/aotstack_seal.json"])
    value = bad_signature["signatures"][0]["signature"]
    bad_signature["signatures"][0]["signature"] = ("0" if value[0] != "0" else "1") + value[1:]
    cases = {
        "changed blob": tamper.write(tmp_path / "blob.pt2", changed_blob),
        "changed manifest": tamper.manifest_edited(signed_path, tmp_path / "manifest.pt2", loosen, reseal=False),
        "changed and resealed manifest": tamper.manifest_edited(signed_path, tmp_path / "resealed.pt2", loosen),
        "bad signature": tamper.write(
            tmp_path / "signature.pt2", {**contents, "extra/aotstack_seal.json": json.dumps(bad_signature).encode()}
        ),
        "unsigned": lowered_package("linear")[1],
    }
    results = run_child(
        REFUSALS, json.dumps({k: str(v) for k, v in cases.items()}), str(signed_path), str(keys / "release.pub")
    )
    assert results["changed blob"].startswith("PackageError")
    assert "does not match its SHA-256" in results["changed blob"]
    assert "does not match its seal" in results["changed manifest"]
    assert results["changed and resealed manifest"].startswith("SignatureError")
    assert "does not verify" in results["changed and resealed manifest"]
    assert "does not verify" in results["bad signature"]
    assert results["unsigned"].startswith("SignatureError") and "is not signed" in results["unsigned"]
    assert results["libraries before the good load"] == []
    assert results["runners before the good load"] == 0
    assert len(results["libraries after the good load"]) == 1


@pytest.mark.parametrize(
    "target",
    ["operator.attrgetter", "operator.call", "builtins.eval", "os.system", "aten.add_.Tensor", "aten.add.out",
     "aten.from_file.default", "higher_order.run_const_graph", "aotstack.call_delegate.default", "torch.load",
     "torch.sym_fresh_size"],
)
def test_a_plan_step_calling_outside_the_closed_list_is_refused(lowered_package, tmp_path, target):
    def call_it(manifest):
        tamper.op_steps(manifest)[0]["target"] = target

    source = lowered_package("split", exclude_ops=("aten.sigmoid",))[1]
    path = tamper.manifest_edited(source, tmp_path / "t.pt2", call_it)
    with pytest.raises(aotstack.PackageError, match=f"plan step '[a-z_0-9]+': calls '{target}'"):
        aotstack.load(path)
