"""Run tensorizer 2.12.1's own test suite twice: against tensorizer, then the compat package.

Owns: fetching the sdist (``pip download --no-deps --no-binary :all:``) into the
git-ignored ``.cache/tensorizer-sdist/``, extracting its ``tests/``, installing the
suite's own test-only dependencies (moto 4, werkzeug, flask...) with ``--no-deps``
into ``.cache/tensorizer-suite/deps`` (never into the project venv), building the
offline stand-in ``EleutherAI/gpt-neo-125M``, starting SeaweedFS (tests/servers) as
the "public bucket" the S3 tests read, running pytest once per target, and comparing.

Exit status: 0 when every test that passes against tensorizer also passes against
``tensorstream.compat.tensorizer`` (and both identity checks held), 1 otherwise.

Usage: ``python scripts/tensorizer_suite/run.py [--only compat|tensorizer] [-k EXPR]``
(``make test-tensorizer-suite``). Deselections and their reasons: ``DESELECTED``
below, mirrored in docs/compat.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = ROOT / ".cache"
SDIST_DIR = CACHE / "tensorizer-sdist"
WORK = CACHE / "tensorizer-suite"
VERSION = "2.12.1"
#: The suite's own test dependencies that the project venv lacks; --no-deps, pinned.
SUITE_DEPS = (
    "moto==4.2.14",
    "werkzeug==3.0.6",
    "flask==3.0.3",
    "flask-cors==4.0.1",
    "xmltodict==0.13.0",
    "responses==0.25.0",
    "itsdangerous==2.2.0",
    "blinker==1.8.2",
    "cryptography==43.0.3",
)
_MODEL = "EleutherAI/gpt-neo-125M"

#: node id -> why it cannot run here (docs/compat.md lists the same).
DESELECTED: dict[str, str] = {
    "test_syscalls.py": "tests tensorizer's private `_syscalls` module",
    **{
        f"test_stream_io.py::TestCurlStream::{name}": "reads a github.com URL (internet)"
        for name in (
            "test_curl_stream",
            "test_curl_stream_begin",
            "test_curl_stream_end",
            "test_curl_stream_begin_and_end",
            "test_curl_stream_invalid_range",
            "test_curl_stream_buffer_end",
            "test_curl_stream_seek",
            "test_curl_stream_seek_forward",
        )
    },
    "test_stream_io.py::TestRedis::test_redis_stream": "Redis (not supported by tensorstream)",
    "test_serialization.py::TestDeserialization::test_redis": (
        "Redis (not supported by tensorstream)"
    ),
    "test_serialization.py::TestDeserialization::test_s3_multiple_readers": (
        "its second half passes s3_endpoint='object.ord1.coreweave.com' explicitly "
        "(CoreWeave's public bucket, internet)"
    ),
    "test_stream_io.py::TestS3::test_download_url": (
        "tests the private `stream_io._s3_download_url` (a boto3 presigned URL)"
    ),
    "test_serialization.py::TestVerification::test_verification_fail": (
        "patches tensorizer's internal construction of TensorHash objects while it parses "
        "headers; tensorstream's verifier does not build them (hash mismatches are tested "
        "in tests/compat)"
    ),
    "test_stream_io.py::TestS3::test_upload": (
        "moto intercepts boto3 inside the process; tensorstream does not use boto3, so "
        "its upload would go to CoreWeave's real endpoint (internet). S3 uploads through "
        "open_stream are tested against SeaweedFS in tests/compat"
    ),
}


def log(msg: str) -> None:
    print(f"[tensorizer-suite] {msg}", flush=True)


def sdist() -> Path:
    archive = SDIST_DIR / f"tensorizer-{VERSION}.tar.gz"
    if not archive.exists():
        SDIST_DIR.mkdir(parents=True, exist_ok=True)
        log(f"downloading the tensorizer {VERSION} sdist")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
             ":all:", f"tensorizer=={VERSION}", "-d", str(SDIST_DIR)],
            check=True,
        )  # fmt: skip
    return archive


def extract_tests(archive: Path) -> Path:
    dest = WORK / "suite"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    prefix = f"tensorizer-{VERSION}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for m in members:
            m.name = m.name[len(f"tensorizer-{VERSION}/") :]
        tar.extractall(dest, members=members, filter="data")
    # An empty config keeps the project's pytest settings out of the suite's run.
    (dest / "pytest.ini").write_text("[pytest]\n")
    return dest / "tests"


def suite_deps() -> Path:
    target = WORK / "deps"
    stamp = target / (".installed-" + "-".join(SUITE_DEPS).replace("/", "_"))
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        log("installing the suite's test-only dependencies (moto 4, werkzeug, ...)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
             str(target), *SUITE_DEPS],
            check=True,
        )  # fmt: skip
        stamp.touch()
    return target


def publish_bucket(server: object, snapshot: Path, scratch: Path) -> None:
    """Put the stand-in model where the suite's S3 tests look (bucket ``tensorized``)."""
    import torch
    from tensorizer import TensorSerializer  # the real one, in this helper process
    from transformers import AutoModelForCausalLM

    client = server.client()  # type: ignore[attr-defined]
    client.create_bucket(Bucket="tensorized")
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    for suffix, dtype in (("", torch.float32), ("fp16/", torch.float16)):
        path = scratch / f"model{dtype}.tensors"
        s = TensorSerializer(str(path))
        s.write_module(model.to(dtype))
        s.close()
        client.upload_file(str(path), "tensorized", f"{_MODEL}/{suffix}model.tensors")
        path.unlink()


def run_target(
    target: str, tests: Path, env: dict[str, str], results: Path, extra: list[str]
) -> dict[str, str]:
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "suite_plugin", "-p", "no:cacheprovider",
        "-c", str(tests.parent / "pytest.ini"), "--rootdir", str(tests.parent),
        "-W", "ignore::DeprecationWarning", "--durations=5", "tests",
    ]  # fmt: skip
    for nodeid in DESELECTED:
        # A whole file is ignored (not even imported); single tests are deselected.
        cmd += ["--deselect" if "::" in nodeid else "--ignore", f"tests/{nodeid}"]
    cmd += extra
    run_env = dict(env, TS_SUITE_TARGET=target, TS_SUITE_RESULTS=str(results))
    log(f"running the suite against {target}")
    started = time.monotonic()
    proc = subprocess.run(cmd, env=run_env, cwd=tests.parent)
    log(f"{target}: pytest exit {proc.returncode} in {time.monotonic() - started:.0f}s")
    if not results.exists():
        return {"<run>": "error"}
    raw = json.loads(results.read_text())
    # Node ids are absolute paths under the extracted suite; keep them short.
    return {k.split("tests/", 1)[-1]: v for k, v in raw.items()}


def counts(outcomes: dict[str, str]) -> str:
    keys = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{sum(v == k for v in outcomes.values())} {k}" for k in keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("compat", "tensorizer"))
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k expr)")
    args = ap.parse_args(argv)

    tests = extract_tests(sdist())
    deps = suite_deps()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_neo import build  # noqa: E402 - the script's own directory

    from servers.seaweed import S3Server  # noqa: E402 - the project's test servers

    hf_home = WORK / "hf_home"
    snapshot = build(hf_home)
    scratch = Path(tempfile.mkdtemp(prefix="tensorizer-suite-"))
    server = S3Server.start(scratch / "seaweedfs")
    try:
        os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
        publish_bucket(server, snapshot, scratch)
        # A fresh HOME: no ~/.s3cfg or ~/.aws of the developer leaks in. The SeaweedFS
        # keys go in its ~/.aws files, not in AWS_* variables: the suite's moto set-up
        # overwrites those variables and its tear-down fails when it finds any.
        home = scratch / "home"
        (home / ".aws").mkdir(parents=True)
        (home / ".aws" / "credentials").write_text(
            f"[default]\naws_access_key_id = {server.access_key}\n"
            f"aws_secret_access_key = {server.secret_key}\n"
        )
        (home / ".aws" / "config").write_text(f"[default]\nregion = {server.region}\n")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AWS_", "S3_")) and k != "PYTHONPATH"
        }
        env.update(
            HOME=str(home),
            HF_HOME=str(hf_home),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join([str(HERE), str(deps), str(ROOT / "src")]),
            # The suite's S3 tests read s3://tensorized/... with no endpoint: both
            # libraries then take AWS_ENDPOINT_URL_S3, here the local SeaweedFS.
            AWS_ENDPOINT_URL_S3=server.endpoint,
        )
        targets = [args.only] if args.only else ["tensorizer", "compat"]
        results = {
            t: run_target(t, tests, env, scratch / f"{t}.json", args.pytest_args) for t in targets
        }
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    print()
    log(f"deselected on both: {len(DESELECTED)} entries (reasons in docs/compat.md)")
    for t, outcomes in results.items():
        log(f"{t:>10}: {counts(outcomes)}")
    if len(results) < 2:
        bad = [k for k, v in results[targets[0]].items() if k.startswith("<")]
        return 1 if bad else 0
    ref, ours = results["tensorizer"], results["compat"]
    regressions = sorted(k for k, v in ref.items() if v == "passed" and ours.get(k) != "passed")
    gains = sorted(k for k, v in ours.items() if v == "passed" and ref.get(k) != "passed")
    for k in regressions:
        log(f"REGRESSION (passes on tensorizer, {ours.get(k, 'missing')} on compat): {k}")
    for k in gains:
        log(f"passes on compat only ({ref.get(k, 'missing')} on tensorizer): {k}")
    identity = [t for t, o in results.items() if "<identity>" in o or "<run>" in o]
    for t in identity:
        log(f"the {t} run did not test what it claims (see its output)")
    if regressions or identity:
        return 1
    log("every test that passes against tensorizer passes against the compat package")
    return 0


if __name__ == "__main__":
    sys.exit(main())
