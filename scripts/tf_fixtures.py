"""Write small GPT-2 checkpoints in OpenAI's original layout with TensorFlow itself, as genuine fixtures for
gpt2port's TensorFlow reader (which never uses TensorFlow). Needs tensorflow-cpu, which is not a dependency of
gpt2port: run it from an environment that has it, e.g.

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu numpy
    /tmp/tfvenv/bin/python scripts/tf_fixtures.py tests/fixtures/tf

It writes, each as OpenAI's download_model.py leaves a size directory (checkpoint, hparams.json, model.ckpt.index,
model.ckpt.data-*, model.ckpt.meta), with TensorFlow's tf.compat.v1.train.Saver, as OpenAI's code saved them:
  tiny/      2 layers, width 16, 2 heads, vocab 96, context 24; one data shard
  sharded/   the same weights saved by a sharded Saver over two devices: several data shards
  nonfloat/  the same weights plus an int32 variable (what a reader must refuse in one line)
and weights.npz beside each: the same arrays as numpy wrote them, an independent copy for the tests to compare to.

    /tmp/tfvenv/bin/python scripts/tf_fixtures.py OUT --size gpt2-xl

writes one full-size checkpoint of random weights at OUT (for scripts/bench/convert.py; no weights.npz).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HPARAMS = {"n_vocab": 96, "n_ctx": 24, "n_embd": 16, "n_head": 2, "n_layer": 2}


SIZES = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
         "gpt2-xl": (48, 1600, 25)}


def arrays(seed: int = 0, hparams: dict = HPARAMS) -> dict[str, np.ndarray]:
    """GPT-2's variables under OpenAI's names and shapes (Conv1D weights [1, in, out]), random but well scaled."""
    rng = np.random.default_rng(seed)
    V, P, C, L = hparams["n_vocab"], hparams["n_ctx"], hparams["n_embd"], hparams["n_layer"]

    def normal(*shape, std=0.2):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    out = {"model/wte": normal(V, C), "model/wpe": normal(P, C, std=0.05)}
    for i in range(L):
        h = f"model/h{i}"
        out.update({
            f"{h}/ln_1/g": 1 + normal(C, std=0.1), f"{h}/ln_1/b": normal(C, std=0.1),
            f"{h}/attn/c_attn/w": normal(1, C, 3 * C), f"{h}/attn/c_attn/b": normal(3 * C, std=0.1),
            f"{h}/attn/c_proj/w": normal(1, C, C), f"{h}/attn/c_proj/b": normal(C, std=0.1),
            f"{h}/ln_2/g": 1 + normal(C, std=0.1), f"{h}/ln_2/b": normal(C, std=0.1),
            f"{h}/mlp/c_fc/w": normal(1, C, 4 * C), f"{h}/mlp/c_fc/b": normal(4 * C, std=0.1),
            f"{h}/mlp/c_proj/w": normal(1, 4 * C, C), f"{h}/mlp/c_proj/b": normal(C, std=0.1),
        })
    out.update({"model/ln_f/g": 1 + normal(C, std=0.1), "model/ln_f/b": normal(C, std=0.1)})
    return out


def save(out: Path, weights: dict[str, np.ndarray], shards: int = 1) -> None:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    out.mkdir(parents=True, exist_ok=True)
    graph = tf.Graph()
    with graph.as_default():
        variables = {}
        for i, (name, value) in enumerate(weights.items()):
            with tf.device(f"/cpu:{i % shards}"):
                variables[name] = tf.compat.v1.Variable(value, name=f"v{i}")
        saver = tf.compat.v1.train.Saver(var_list=variables, sharded=shards > 1)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": shards})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(out / "model.ckpt"), write_meta_graph=True)
    (out / "hparams.json").write_text(json.dumps(HPARAMS, indent=2))
    np.savez(out / "weights.npz", **{k.replace("/", "."): v for k, v in weights.items()})


def save_large(out: Path, hparams: dict, seed: int = 0) -> None:
    """A full-size checkpoint without holding its weights twice: variables made empty, then filled one at a time
    from freshly drawn arrays (a graph of constants would hold every array again, and 1.5B parameters twice
    over do not fit in 24 GB)."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    out.mkdir(parents=True, exist_ok=True)
    names = {name: value.shape for name, value in arrays(seed, {**hparams, "n_layer": 1}).items()}
    shapes = {}
    for name, shape in names.items():  # every block's variables have block 0's shapes
        if name.startswith("model/h0/"):
            for i in range(hparams["n_layer"]):
                shapes[name.replace("model/h0/", f"model/h{i}/")] = shape
        else:
            shapes[name] = shape
    V, P = hparams["n_vocab"], hparams["n_ctx"]
    shapes["model/wte"], shapes["model/wpe"] = (V, hparams["n_embd"]), (P, hparams["n_embd"])
    rng = np.random.default_rng(seed)
    with tf.Graph().as_default():
        variables = {name: tf.compat.v1.get_variable(f"v{i}", shape, tf.float32, tf.zeros_initializer())
                     for i, (name, shape) in enumerate(shapes.items())}
        saver = tf.compat.v1.train.Saver(var_list=variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for name, var in variables.items():
                var.load(rng.normal(0.0, 0.02, size=shapes[name]).astype(np.float32), sess)
            saver.save(sess, str(out / "model.ckpt"), write_meta_graph=False)
    (out / "hparams.json").write_text(json.dumps(hparams, indent=2))


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tf")
    if "--size" in sys.argv:
        n_layer, n_embd, n_head = SIZES[sys.argv[sys.argv.index("--size") + 1]]
        hp = {"n_vocab": 50257, "n_ctx": 1024, "n_embd": n_embd, "n_head": n_head, "n_layer": n_layer}
        save_large(root, hp)
        return
    weights = arrays()
    save(root / "tiny", weights)
    save(root / "sharded", weights, shards=2)
    save(root / "nonfloat", {**weights, "model/step": np.array([7, 8, 9], dtype=np.int32)})
    for d in sorted(root.iterdir()):
        print(d, sorted(p.name for p in d.iterdir()))


if __name__ == "__main__":
    main()
