"""Extract vLLM's own fs-tier tests for ``$KVTIER_VLLM_VERSION`` from its sdist (cached in
``$KVTIER_VLLM_SDIST_DIR``, default ``~/.cache/kvtier/vllm-sdist``; downloaded from PyPI once if
absent) and print the test file's path. The file is vLLM's, unmodified, with the
``tests/v1/kv_offload/conftest.py`` it shares with its neighbours."""

from __future__ import annotations

import os
import sys
import tarfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import vllm_harness as H  # noqa: E402

MEMBERS = ("tests/v1/kv_offload/tiering/test_fs_tier.py", "tests/v1/kv_offload/conftest.py")


def sdist(version: str) -> str:
    d = os.environ.get("KVTIER_VLLM_SDIST_DIR") or os.path.expanduser("~/.cache/kvtier/vllm-sdist")
    path = os.path.join(d, f"vllm-{version}.tar.gz")
    if not os.path.isfile(path):
        os.makedirs(d, exist_ok=True)
        index = urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=60).read().decode()
        name = f"vllm-{version}.tar.gz"
        at = index.index(name)
        url = index[index.rindex('href="', 0, at) + 6: index.index('"', at)].split("#")[0]
        tmp = path + ".part"
        urllib.request.urlretrieve(url, tmp)
        os.rename(tmp, path)
    return path


def extract(version: str) -> str:
    base = os.path.join(os.environ.get("KVTIER_VLLM_CACHE") or "/tmp/kvtier-vllm-harness",
                        f"vllm-own-{version}")
    test = os.path.join(base, "v1", "kv_offload", "tiering", "test_fs_tier.py")
    if os.path.isfile(test):
        return test
    with tarfile.open(sdist(version)) as tf:
        for member in MEMBERS:
            data = tf.extractfile(f"vllm-{version}/{member}").read()
            out = os.path.join(base, member.removeprefix("tests/"))
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(data)
    for d in ("v1", "v1/kv_offload", "v1/kv_offload/tiering"):
        open(os.path.join(base, d, "__init__.py"), "a").close()
    return test


if __name__ == "__main__":
    print(extract(H.VLLM_VERSION))
