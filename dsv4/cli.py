"""`dsv4` command line: serve | generate | chat | bench | roofline | make-tiny."""

from __future__ import annotations

import argparse
import logging
import sys

from dsv4.config import AUTO_SEQ_LEN, KV_CACHE_DTYPES, SCHEDULING_POLICIES

ENGINE_FIELDS = (  # the engine flags (_engine_flags) as LLM keyword arguments
    "device",
    "dtype",
    "quantized",
    "ops",
    "max_seq_len",
    "max_seqs",
    "chunk_size",
    "max_step_tokens",
    "block_size",
    "max_memory",
    "max_total_tokens",
    "memory_fraction",
    "gpu_memory_utilization",
    "cuda_graphs",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "speculative_config",
    "enable_prefix_caching",
    "prefix_snapshots",
    "enable_layerwise_nvtx_marker",
    "scheduling_policy",
    "priority_preemption_threshold",
)


def _chunk_size(text: str) -> int | None:
    """--chunk-size: tokens, or -1 (SGLang's --chunked-prefill-size -1, no chunking): None, a
    chunk as long as the step budget allows."""
    n = int(text)
    return None if n == -1 else n


_chunk_size.__name__ = "int"  # argparse's message for a bad value: "invalid int value"


def _seq_len(text: str) -> int:
    """--max-seq-len: tokens, or auto / -1 (vLLM's --max-model-len auto): the longest sequence
    the state's budget holds, at most the model's own limit (`config.AUTO_SEQ_LEN`)."""
    return AUTO_SEQ_LEN if text in ("auto", "-1") else int(text)


_seq_len.__name__ = "int"


def build_llm(source):  # noqa: ANN001, ANN201  (argparse.Namespace or ServerConfig)
    """The LLM that `source`'s model and engine flags describe."""
    from dsv4.llm import LLM

    return LLM(source.model, **{name: getattr(source, name) for name in ENGINE_FIELDS})


def _generate(ns: argparse.Namespace) -> int:
    from dsv4.sampling import SamplingParams

    llm = build_llm(ns)
    params = SamplingParams(
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        min_p=ns.min_p,
        seed=ns.seed,
        max_tokens=ns.max_tokens,
        ignore_eos=ns.ignore_eos,
        stop=ns.stop,
        repetition_penalty=ns.repetition_penalty,
    )
    outs = llm.generate(ns.prompt, params)
    llm.close()  # tensor parallel: the other ranks stop
    for prompt, out in zip(ns.prompt, outs):
        if len(ns.prompt) > 1:
            print(f"--- {prompt!r}")
        print(out.text if llm.tokenizer is not None else out.token_ids)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _chat(ns: argparse.Namespace) -> int:
    from dsv4.chat import encode_messages
    from dsv4.sampling import SamplingParams

    llm = build_llm(ns)
    if llm.tokenizer is None:
        print("error: the model has no tokenizer", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.seed)
    messages: list[dict] = []
    print("dsv4 chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = encode_messages(messages, thinking=ns.thinking)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False).ids
        out = llm.generate([ids], params)[0]
        print(f"assistant> {out.text}")
        messages.append({"role": "assistant", "content": out.text})
    llm.close()  # tensor parallel: the other ranks stop
    return 0


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "--model-path", default=None, help="checkpoint directory (default: demo model)"
    )
    # "auto" / unset: the GPU fast path when torch sees CUDA, else the exact CPU reference path
    # (`dsv4.config.resolve_engine`)
    p.add_argument("--device", default="auto", help="cpu | cuda[:N] | auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep FP8/FP4 weights packed (default: on a GPU)",
    )
    p.add_argument(
        "--ops",
        default="auto",
        choices=["auto", "ref", "triton"],
        help="op backend (triton: GPU kernels; default: triton on a GPU, ref on the CPU)",
    )
    # (the peers' names for the same settings are aliases: vLLM's, then SGLang's)
    p.add_argument(
        "--max-seq-len", "--max-model-len", "--context-length", type=_seq_len, default=4096,
        help="tokens a sequence may hold, prompt and output; auto: the longest the state's "
        "budget holds (at most the model's limit), as vLLM's --max-model-len auto",
    )  # fmt: skip
    p.add_argument(
        "--max-seqs", "--max-num-seqs", "--max-running-requests", type=int, default=8,
        help="max running sequences",
    )  # fmt: skip
    p.add_argument(
        "--chunk-size", "--chunked-prefill-size", type=_chunk_size, default=None,
        help="prefill chunk of one sequence (tokens; default and -1, SGLang's 'no chunking': "
        "--max-step-tokens, as vLLM)",
    )  # fmt: skip
    p.add_argument(
        "--max-step-tokens", "--max-num-batched-tokens", type=int, default=2048,
        help="tokens one engine step runs at most, all sequences together",
    )  # fmt: skip
    p.add_argument(
        "--block-size", "--page-size", type=int, default=None,
        help="tokens a state page covers (a multiple of both compress ratios; default: the "
        "smallest such multiple >= 256)",
    )  # fmt: skip
    p.add_argument(
        "--max-memory", "--kv-cache-memory-bytes", type=int, default=None,
        help="state budget in bytes (vLLM's --kv-cache-memory-bytes)",
    )  # fmt: skip
    p.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="SGLang's: at most this many tokens in the state's pages (a cap on what the budget "
        "gives)",
    )  # fmt: skip
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="state budget as a fraction of free device memory after weights",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=float,
        default=None,
        help="fraction of the GPU's total memory for the weights, a step's activations and the "
        "state together, as vLLM's / SGLang's flag: the state gets it less what the GPU holds "
        "once the weights are loaded and the activations' peak of a profiled step",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps as CUDA graphs (needs a CUDA device, --ops triton and "
        "--quantized; default: on where they hold)",
    )
    p.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_false",
        help="no CUDA graphs (as vLLM's flag; same as --no-cuda-graphs)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        type=lambda v: {"fp8_e4m3": "fp8", "fp8_ds_mla": "fp8"}.get(v, v),  # vLLM's names
        choices=KV_CACHE_DTYPES,
        help="attention state: auto = the compute dtype; fp8 = FP8 entries (584 B at Flash "
        "width: e4m3 nope, bf16 rope, UE8M0 scales), as vLLM's fp8_ds_mla",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        "--tp",
        type=int,
        default=1,
        help="ranks, one GPU each: attention heads and the shared expert split, routed experts "
        "spread (expert parallel); ranks 1.. are started here, or by torchrun",
    )
    p.add_argument(
        "--speculative-config",
        "--speculative_config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM: \'{"method": "mtp", "num_speculative_tokens": 1}\' '
        "(the model's MTP layer drafts; the next step verifies)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching, on by default as in vLLM (--no-enable-prefix-caching: off): a "
        "prompt starts from the state another left at a block boundary (shared pages, a "
        "snapshot of the rings there)",
    )
    p.add_argument(
        "--prefix-snapshots",
        type=int,
        default=None,
        help="with prefix caching: ring snapshots kept (each one slot's fixed state; default 4 "
        "per --max-seqs)",
    )
    p.add_argument(
        "--enable-layerwise-nvtx-marker",
        action="store_true",
        help="SGLang's: NVTX ranges around each layer, its attention and its feed-forward, for "
        "Nsight Systems (a CUDA device)",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="fcfs (default): arrival order; priority: requests' `priority`, lower first, then "
        "arrival (admission, the step's budget, and who is preempted first), as vLLM's; "
        "priority-high-first: higher first, SGLang's default order",
    )
    p.add_argument(
        "--priority-scheduling-preemption-threshold",
        dest="priority_preemption_threshold",
        type=int,
        default=None,
        help="SGLang's: under a priority policy, a waiting request that cannot be admitted "
        "preempts running ones whose priority it beats by more than this (default: never, as "
        "vLLM; 10 with --enable-priority-scheduling)",
    )


def _make_tiny(ns: argparse.Namespace) -> int:
    from dsv4.config import CSA, HCA, SLIDING
    from dsv4.tiny import LAYER_NAMES, make_tiny, tiny_args

    over: dict = {
        "weight_dtype": ns.weight_dtype,
        "expert_dtype": ns.expert_dtype,
        "n_mtp_layers": 0 if ns.no_mtp else 1,
    }
    if ns.layers:
        names = ns.layers.split(",")
        bad = [n for n in names if n not in LAYER_NAMES]
        if bad:
            print(
                f"error: --layers entries must be in {sorted(LAYER_NAMES)}, got {bad}",
                file=sys.stderr,
            )
            return 2
        over["layer_types"] = tuple(LAYER_NAMES[n] for n in names)
    for key in ("vocab_size", "dim", "n_routed_experts"):
        if getattr(ns, key) is not None:
            over[key] = getattr(ns, key)
    args = tiny_args(**over)
    out = make_tiny(ns.out_dir, args, seed=ns.seed, tokenizer=ns.tokenizer)
    kinds = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
    print(
        f"wrote {out}: {args.n_layers} layers ({','.join(kinds[t] for t in args.layer_types)}), "
        f"dense {args.weight_dtype}, experts {args.expert_dtype}, mtp={args.n_mtp_layers}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (default: the built-in demo model)")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    _engine_flags(g)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.set_defaults(fn=_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat (DeepSeek-V4 prompt format)")
    _engine_flags(c)
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--thinking", action="store_true", help="thinking mode prompt")
    c.set_defaults(fn=_chat)

    t = sub.add_parser("make-tiny", help="write a random tiny model in the official layout")
    t.add_argument("out_dir")
    t.add_argument("--layers", default=None, help="comma list of sliding|csa|hca (default s,c,h,c)")
    t.add_argument("--dim", type=int, default=None)
    t.add_argument("--vocab-size", type=int, default=None)
    t.add_argument("--n-routed-experts", type=int, default=None)
    t.add_argument("--weight-dtype", default="fp8", choices=["fp8", "bf16"])
    t.add_argument("--expert-dtype", default="fp4", choices=["fp4", "nvfp4", "fp8", "bf16"])
    t.add_argument("--no-mtp", action="store_true", help="omit the mtp.0.* tensors")
    t.add_argument("--tokenizer", default="auto", choices=["auto", "deepseek", "bytes", "none"])
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=_make_tiny)

    r = sub.add_parser("roofline", help="analytic floor of a decode/prefill step", add_help=False)
    r.set_defaults(fn=None)

    for name, help_ in (
        ("serve", "OpenAI-compatible HTTP server (default: the built-in demo model)"),
        ("run-batch", "an OpenAI batch file (JSON lines) through the server's routes, offline"),
        ("bench", "benchmarks: `dsv4 bench step` (one decode/prefill step at real width)"),
    ):
        sub.add_parser(name, help=help_, add_help=False).set_defaults(fn=None)

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "roofline":
        from dsv4.roofline import main as roofline_main

        return roofline_main(argv[1:])
    if argv and argv[0] == "serve":
        from dsv4.server import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "run-batch":
        from dsv4.batch import main as batch_main

        return batch_main(argv[1:])
    if argv and argv[0] == "bench":
        from dsv4.bench import main as bench_main

        return bench_main(argv[1:])
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's start-up lines
    try:
        return ns.fn(ns)
    except (ValueError, FileNotFoundError) as e:  # config/checkpoint/request errors: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
