#!/usr/bin/env python3
"""CTranslate2's side of bench/run_peers_translate.sh: translate a TSV's sources, timed.

    peers_translate.py MODEL_DIR INPUT.tsv OUT.txt --beam K --batch B --threads N
                       [--max-len L] [--length-penalty A] [--inter]

Reads "source<TAB>target" lines (or plain sources), appends <eos> to each source (attn's
batches end every source with it; the converted model adds none itself), and translates them
in consecutive batches of B lines, the batches `attn translate --batch-size B` forms, with
ctranslate2.Translator(intra_threads=N, inter_threads=1), fp32 (compute_type float32); with
--inter, Translator(intra_threads=1, inter_threads=N) instead: N replicas of the model, each
batch submitted asynchronously and taken by a free replica, results collected in order (how
CTranslate2 runs batches side by side; `attn translate` does the same with more than one batch
and more than one thread). Greedy is
beam 1 (sampling off); beam search uses attn's rule: length_penalty alpha (score log P / L^alpha),
patience 1 (a source is done when it has K finished hypotheses), max_decoding_length L tokens
with <eos> (attn translate's --max-len, default the model's num_steps). Writes one translation
per line to OUT.txt and prints a JSON object: seconds of translate_batch calls (after one
untimed batch; the model load is reported apart), sentences, target tokens written (without <eos>).
"""
import argparse
import json
import time

import ctranslate2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=11)
    ap.add_argument("--length-penalty", type=float, default=0.75)
    ap.add_argument("--inter", action="store_true",
                    help="N replicas of one thread each (inter_threads = N) instead of one of N")
    args = ap.parse_args()
    intra, inter = (1, args.threads) if args.inter else (args.threads, 1)
    sources = [line.rstrip("\n").split("\t")[0].split() + ["<eos>"]
               for line in open(args.input)]
    t0 = time.perf_counter()
    translator = ctranslate2.Translator(args.model, device="cpu", compute_type="float32",
                                        intra_threads=intra, inter_threads=inter)
    load_s = time.perf_counter() - t0
    # One untimed batch first: CTranslate2's first call sets up its thread pool and allocator
    # caches (attn's process start and load are taken out of its time likewise).
    translator.translate_batch(sources[:args.batch], beam_size=args.beam,
                               max_decoding_length=args.max_len)
    out = []
    t0 = time.perf_counter()
    pending = []
    for i in range(0, len(sources), args.batch):
        results = translator.translate_batch(
            sources[i:i + args.batch], beam_size=args.beam, patience=1.0,
            length_penalty=args.length_penalty if args.beam > 1 else 0.0,
            max_decoding_length=args.max_len, return_scores=False, asynchronous=args.inter)
        if args.inter:
            pending += results
        else:
            out += [r.hypotheses[0] for r in results]
    out += [r.result().hypotheses[0] for r in pending]
    seconds = time.perf_counter() - t0
    with open(args.output, "w") as f:
        for tokens in out:
            f.write(" ".join(tokens) + "\n")
    print(json.dumps({"seconds": seconds, "load_seconds": load_s, "sentences": len(out),
                      "tokens": sum(len(t) for t in out), "ctranslate2": ctranslate2.__version__,
                      "beam": args.beam, "batch": args.batch, "threads": args.threads,
                      "inter": args.inter}))


if __name__ == "__main__":
    main()
