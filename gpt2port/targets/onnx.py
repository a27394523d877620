"""The onnx target: one ONNX graph of gpt2port's own forward, for prefill and decode, proven by onnxruntime.

    model.onnx        the graph, with optimum's names: inputs input_ids, attention_mask, position_ids (int64) and
                      past_key_values.{i}.key/value (batch, heads, past, head_dim); outputs logits and
                      present.{i}.key/value (the cache to pass to the next call). An empty cache (past 0) is a prompt.
    model.onnx.data   the weights, beside the graph, when they pass protobuf's 2 GB (gpt2-large and up)
    config.json       transformers' config of the model; the tokenizer files
    genai_config.json what onnxruntime-genai reads to run model.onnx: its generic decoder-only model ("decoder"; its
                      "gpt2" type expects the older combined past_{i} cache), these names, greedy search

The graph is torch.export's capture of GPT.forward over a model.PastKV (no second forward: an edit to model.py is
in the next export), translated by torch.onnx (onnxscript). The export ends in proof: onnxruntime prefills a prompt
from an empty cache and is fed the tokens gpt2port's greedy decoding chose, one per call with the cache each call
returned; its logits, and its own greedy choice, at every position are compared with gpt2port's forward over the
same weights; the numbers go to the output and manifest.json, and a failure leaves nothing. onnx, onnxscript and
onnxruntime are the optional `onnx` extra, imported by this target alone.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import warnings

import torch

from gpt2port import checkpoint, records
from gpt2port.config import GPTConfig
from gpt2port.dtypes import DTYPE_LABELS, label
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import copy_file, write_json
from gpt2port.hashing import hash_file
from gpt2port.model import GPT, PastKV
from gpt2port.targets import REGISTRY
from gpt2port.tokenizer import ENDOFTEXT_ID

FILE_NAME = "model.onnx"
GENAI_CONFIG = "genai_config.json"
DATA_NAME = FILE_NAME + ".data"  # torch.onnx's name for the weights kept beside the graph
INLINE_LIMIT = 2 * 1024**3 - 2**26  # protobuf's 2 GB per file, less room for the graph itself
# The proof's bound, max |onnxruntime - gpt2port| / max |gpt2port| over every logit: fp32 graphs agree to float
# rounding; fp16 ones compute in fp16 (their reference is the fp32 forward over the same rounded weights).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
PROMPT, DECODE = 8, 8  # the proof's prompt length and the tokens decoded after it, one per call


def names(n_layer: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of the graph, as optimum's GPT-2 export names them."""
    kv = [f"{i}.{part}" for i in range(n_layer) for part in ("key", "value")]
    return (["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{n}" for n in kv)],
            ["logits", *(f"present.{n}" for n in kv)])


class Step(torch.nn.Module):
    """GPT.forward over a PastKV given as flat tensors (past_key_values in optimum's order), returning the logits and
    the grown cache: the function the graph is."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = PastKV(list(past[0::2]), list(past[1::2]), attention_mask.bool())
        logits, _ = self.model(input_ids, cache=cache, pos=position_ids)
        return (logits, *(t for kv in zip(cache.k, cache.v) for t in kv))


def write(job) -> int:
    """The writer for "onnx" (job: a conversion.Job). Returns the bytes of the graph and its weights."""
    where, config = job.source.where, job.source.config
    if DTYPE_LABELS.get(job.dtype) not in REGISTRY["onnx"].dtypes:
        raise GPT2PortError(f"{where}: the onnx export is fp32 or fp16 (onnxruntime's CPU kernels), not "
                            f"{label(job.dtype)}; pass --dtype fp32 or fp16")
    onnxruntime = _runtime()
    model = GPT.from_state(config, _state(job))
    with job.staged() as stage:
        size = export_graph(model, stage)
        # gpt2port's side of the proof first, so that the model is gone before onnxruntime holds the weights
        # (gpt2-xl: 6 GB each); the export's graphs kept them in reference cycles, hence the collection
        expected = reference(model)
        del model
        gc.collect()
        write_json(stage / checkpoint.CONFIG, {**config.to_hf_config(), "dtype": str(job.dtype).removeprefix("torch.")})
        write_json(stage / GENAI_CONFIG, genai_config(config))
        for f in job.source.tokenizer_files():
            copy_file(f, stage / f.name)
        job.proof = prove(onnxruntime, stage / FILE_NAME, *expected)
        job.write_manifest(stage, "onnx")
    return size


def _runtime():
    try:
        import onnxruntime
        import onnxscript  # noqa: F401 - torch.onnx's translator: missing, the export would fail only after tracing
    except ImportError as e:
        raise GPT2PortError(f"--to onnx needs the onnx extra ({e.name} is not installed): "
                            f"pip install 'gpt2port[onnx]'") from None
    return onnxruntime


def _state(job) -> dict[str, torch.Tensor]:
    """The canonical tensors, in the export's dtype (each read copied: produce() may reuse its buffer)."""
    done, state = 0, {}
    total = sum(torch.Size(shape).numel() * job.dtype.itemsize for _, _, shape, _ in job.items)
    for key, _, _, produce in job.items:
        state[key] = produce().to(job.dtype, copy=True)
        done += state[key].nbytes
        if job.progress:
            job.progress(done, total)
    return state


def export_graph(model: GPT, stage) -> int:
    """Write model.onnx (and model.onnx.data past 2 GB) into `stage`. Returns their bytes."""
    config = model.config
    inputs, outputs = names(config.n_layer)
    batch, seq, past = (torch.export.Dim(n) for n in ("batch_size", "sequence_length", "past_sequence_length"))
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim("total")},
            "position_ids": {0: batch, 1: seq}, "past": ({0: batch, 2: past},) * (2 * config.n_layer)}
    example = _example(config, model.tok_emb.weight.dtype)
    weights = sum(t.nbytes for t in {id(t): t for t in model.state_dict().values()}.values())
    # torch.onnx reports progress with print(), logs the optional operators it skips and warns about the names it
    # chose: none of it is the user's business
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Step(model), example, dynamic_shapes=dims, input_names=inputs,
                                    output_names=outputs, dynamo=True, optimize=True, verbose=False,
                                    artifacts_dir=stage)
        mask = program.model.graph.inputs[1]  # named as optimum names it (torch.export has no sum of two Dims)
        mask.shape = type(mask.shape)([mask.shape[0], "past_sequence_length + sequence_length"])
        program.save(stage / FILE_NAME, external_data=weights > INLINE_LIMIT)
    size = 0
    for path in (stage / n for n in (FILE_NAME, DATA_NAME) if (stage / n).exists()):
        # onnx writes these itself, so their record is taken from the closed files, before anything can change them
        sha256, _ = hash_file(path)
        records.written(path, path.stat().st_size, sha256)
        size += path.stat().st_size
    return size


def genai_config(config: GPTConfig) -> dict:
    """onnxruntime-genai's description of model.onnx. Its "gpt2" model type reads one combined past_{i} per layer
    (onnxruntime's older GPT-2 export); "decoder", its generic decoder-only model, takes the graph by the names given.
    The cache is grown by the graph's concatenation, so genai must not share one buffer between past and present."""
    return {"model": {"type": "decoder", "bos_token_id": ENDOFTEXT_ID, "eos_token_id": ENDOFTEXT_ID,
                      "pad_token_id": ENDOFTEXT_ID, "context_length": config.n_positions,
                      "vocab_size": config.vocab_size,
                      "decoder": {"filename": FILE_NAME, "head_size": config.head_dim, "hidden_size": config.n_embd,
                                  "num_attention_heads": config.n_head, "num_key_value_heads": config.n_head,
                                  "num_hidden_layers": config.n_layer,
                                  "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                             "position_ids": "position_ids",
                                             "past_key_names": "past_key_values.%d.key",
                                             "past_value_names": "past_key_values.%d.value"},
                                  "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                              "present_value_names": "present.%d.value"}}},
            "search": {"max_length": config.n_positions, "do_sample": False, "num_beams": 1,
                       "past_present_share_buffer": False}}


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(before)


def _example(config: GPTConfig, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: every dynamic length distinct and above 1 (torch.export fixes sizes 0 and 1)."""
    B, T, S = 2, 3, 4
    past = [torch.zeros(B, config.n_head, S, config.head_dim, dtype=dtype) for _ in range(2 * config.n_layer)]
    return (torch.zeros(B, T, dtype=torch.long), torch.ones(B, S + T, dtype=torch.long),
            torch.arange(S, S + T).expand(B, T), *past)  # distinct tensors: one passed twice would be one input


def greedy(session, ids: torch.Tensor, mask: torch.Tensor, calls: int,
           follow: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with an onnxruntime `session` of model.onnx: prefill (B, T) `ids` (left-padded where `mask` (B, T) is
    0) from an empty cache, then feed the greedy token (or, given `follow` (B, calls - 1), its tokens), one per call
    with the cache the call before returned, for `calls` calls in all. Returns (ids with the `calls` tokens chosen
    appended, the logits of every call (B, T + calls - 1, V) as fp32)."""
    inputs = {i.name: i for i in session.get_inputs()}
    past = [n for n in inputs if n.startswith("past_key_values.")]
    _, heads, _, head_dim = inputs[past[0]].shape
    dtype = torch.float16 if inputs[past[0]].type == "tensor(float16)" else torch.float32
    feed = dict.fromkeys(past, torch.zeros(ids.size(0), heads, 0, head_dim, dtype=dtype).numpy())
    new, logits = ids, []
    for call in range(calls):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -new.size(1):]  # a padded row counts from its first token
        feed.update(input_ids=new.numpy(), attention_mask=mask.numpy(), position_ids=positions.numpy())
        out = session.run(None, feed)
        feed.update(zip(past, out[1:]))
        logits.append(torch.from_numpy(out[0]).float())
        new = logits[-1][:, -1:].argmax(-1) if follow is None or call == calls - 1 else follow[:, call:call + 1]
        ids, mask = torch.cat((ids, new), 1), torch.cat((mask, torch.ones_like(new)), 1)
    return ids, torch.cat(logits, 1)


def reference(model: GPT) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt2port's side of the proof: its greedy decoding (fp32, the whole sequence each step) of PROMPT random tokens
    for DECODE more. Returns (the prompt and the tokens chosen (1, length), the logits over them (1, length, V))."""
    config = model.config
    length = min(PROMPT + DECODE, config.n_positions)  # the positions fed
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, min(PROMPT, length - 1)), generator=seeded)
    model = model.float()
    with torch.no_grad():
        while tokens.size(1) < length:
            tokens = torch.cat((tokens, model(tokens)[0][:, -1:].argmax(-1)), 1)
        return tokens, model(tokens)[0]


def prove(onnxruntime, path, tokens: torch.Tensor, want: torch.Tensor, prompt: int = PROMPT) -> dict:
    """onnxruntime prefills `prompt` of `tokens` from an empty cache, then is fed the rest (gpt2port's greedy choices,
    `reference`), one per call with the cache it returned; its logits at every position are compared with `want`,
    gpt2port's, and its greedy choice at each with gpt2port's."""
    prompt = min(prompt, tokens.size(1) - 1)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fp16 = session.get_inputs()[-1].type == "tensor(float16)"
    _, got = greedy(session, tokens[:, :prompt], torch.ones_like(tokens[:, :prompt]), tokens.size(1) - prompt + 1,
                    follow=tokens[:, prompt:])
    del session
    length = tokens.size(1)
    error = float((got - want).abs().max() / want.abs().max())
    same = int((got.argmax(-1) == want.argmax(-1)).sum())
    tolerance = TOLERANCE[torch.float16 if fp16 else torch.float32]
    proof = {"runtime": f"onnxruntime {onnxruntime.__version__}", "prompt_tokens": prompt,
             "decoded_tokens": length - prompt, "max_rel_error": error, "tolerance": tolerance,
             "greedy_agree": f"{same}/{length}"}
    if not error <= tolerance:
        raise GPT2PortError(f"{path.name}: onnxruntime's logits differ from gpt2port's by {error:.2e} (relative, max "
                            f"over {length} positions; tolerance {tolerance:.0e}): the export is wrong")
    return proof
