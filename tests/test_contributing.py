"""CONTRIBUTING.md's three worked examples (a hashing method, a data set, an eviction policy) are each one
module plus one config: written into a copy of the tree exactly as the page shows them, they work."""

import re
import shutil
import subprocess
import sys

from ushash.config import ROOT

FILES = ("ushash/hashing/methods/sign_random_rotation.py", "configs/method/sign_random_rotation.yaml",
         "ushash/data/datasets/my_pairs.py", "configs/data/my_pairs.yaml",
         "ushash/serving/cache/policies/fifo.py", "configs/cache/fifo.yaml")


def examples() -> dict[str, str]:
    """path -> the code block that follows the paragraph naming it."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    out = {}
    for path in FILES:
        start = text.index(f"`{path}`")
        block = re.search(r"```(?:python|yaml)\n(.*?)```", text[start:], re.S)
        out[path] = block.group(1)
    return out


CHECK = r'''
import numpy as np
from PIL import Image
from ushash.config import compose
from ushash.data import synthetic
from ushash.hashing import methods
from ushash.data.datasets import load_rows
from ushash.serving.cache.policies import make_policy
import ushash.serving.service  # registers the serve schema

# the method: fitted in the val-chosen shared space, encodes every modality, and its config composes
sp = synthetic.write_synthetic(TMP + "/f", sizes={"train": 200, "val": 60, "test": 60}, n_classes=4,
                               dims={"image": 12, "text": 10})
m = methods.build("sign_random_rotation", 16, seed=1, max_rank="auto", reg="auto").fit(sp["train"], sp["val"])
kind, codes = m.encode("image", sp["test"].tables["image"].x)
assert kind == "codes" and codes.shape == (60, 2)
assert compose("config", ["method=sign_random_rotation"]).method.name == "sign_random_rotation"

# the data set: rows from a TSV, split by item, and a config that composes
import os
os.makedirs(TMP + "/d", exist_ok=True)
lines = []
for i in range(30):
    Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(f"{TMP}/d/{i}.png")
    lines.append(f"{i}.png\tcaption {i}")
open(TMP + "/d/pairs.tsv", "w").write("\n".join(lines))
train = load_rows("my_pairs", "train", path=TMP + "/d/pairs.tsv")
assert train and {r.modality for r in train} == {"image", "text"}
assert compose("config", ["data=my_pairs"]).data.name == "my_pairs"

# the policy: evicts in insertion order within its byte budget, and the preset composes
p = make_policy("fifo", 100)
assert p.insert(1, 60) == [] and p.insert(2, 30) == [] and p.insert(3, 30) == [1] and p.used_bytes == 60
assert compose("serve", ["export=x", "cache=fifo"]).cache.policy == "fifo"
print("ok")
'''


def test_the_three_examples_are_one_module_plus_one_config(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "ushash", tree / "ushash", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", tree / "configs")
    for path, code in examples().items():
        assert not (tree / path).exists(), path
        (tree / path).write_text(code)
    env_code = f"TMP = {str(tmp_path)!r}\n" + CHECK
    out = subprocess.run([sys.executable, "-c", env_code], cwd=tree, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
