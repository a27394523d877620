"""`gpt2port eval`: the figures GPT-2 is compared by (perplexity, LAMBADA, HellaSwag), on any checkpoint gpt2port
reads, at any dtype it runs, and a model judged against its base (KL divergence, top-1 agreement).

    load.py      a model and its tokenizer from anything `convert` reads, its products on the prefill kernel;
                 `logits`, the one call of the model
    data.py      the input files: a text, a jsonl (every refusal names the file and the line)
    windows.py   perplexity over one long text: the sliding window, batched; --against
    choices.py   log-likelihoods of continuations: LAMBADA and HellaSwag (the harness's and nanoGPT's protocols)
    published.py names of published datasets (fetched, hash-checked, cached; or the line saying to pass a file)
    ranks.py     under torchrun: the batches dealt over the ranks, the results gathered
    report.py    the table, the JSON and the model card's model-index block
    run.py       the command: load, score, report
"""
