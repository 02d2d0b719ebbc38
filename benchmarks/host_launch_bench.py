"""What one kernel launch costs the host on MLX-CUDA, by what the launch carries.

    python benchmarks/host_launch_bench.py [--launches 87] [--steps 200]

A decode step of fuselm's is host-bound on the H200 (~12 µs of host time per launch against
~11 µs of GPU work for Llama-3.2-1B: BENCHMARKS.md 'Runtime settings measured against the
default'), so this separates the parts of a
launch's host cost: a compiled chain of `--launches` tiny launches is built and `mx.async_eval`ed
`--steps` times without waiting (the tiny kernels keep the host the bound), and the host
seconds per launch are reported for: a custom kernel with one input and a short body; the same
with 8 inputs; the same with a body as long as fuselm's GEMV (~5 KB of text, which MLX hashes
at every launch); and with 3 outputs. (A chain of MLX's own elementwise ops is no comparison:
mx.compile fuses it into one launch.) Run it once per MLX setting
(MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER) in separate processes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

BODY = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x0[i] + T(1);
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=87, help="launches per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("-r", type=int, default=5, help="repeats (median)")
    args = ap.parse_args()

    import mlx.core as mx

    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA backend")
    # a body as long as a compact GEMV's text: statements the compiler folds away
    long_body = BODY + "".join(f"  if (N < {-1 - j}) y[0] = T({j});\n" for j in range(160))

    def custom(name: str, inputs: int, body: str, outputs: int = 1):  # noqa: ANN202
        k = mx.fast.cuda_kernel(name=name, input_names=[f"x{j}" for j in range(inputs)],
                                output_names=["y"] + [f"z{j}" for j in range(outputs - 1)],
                                source=body)

        def launch(x: mx.array, extra: list[mx.array]) -> mx.array:
            return k(inputs=[x, *extra[:inputs - 1]], template=[("T", x.dtype), ("N", x.size)],
                     grid=(x.size, 1, 1), threadgroup=(min(256, x.size), 1, 1),
                     output_shapes=[x.shape] * outputs,
                     output_dtypes=[x.dtype] * outputs)[0]
        return launch

    variants = {
        "custom_1_input": custom("hb_one", 1, BODY),
        "custom_8_inputs": custom("hb_eight", 8, BODY),
        "custom_long_text": custom("hb_long", 1, long_body),
        "custom_3_outputs": custom("hb_three", 1, BODY, outputs=3),
    }
    x0 = mx.zeros((2048,), mx.float16)
    extra = [mx.zeros((4096,), mx.float16) for _ in range(7)]
    mx.eval(x0, *extra)
    report: dict[str, object] = {"launches": args.launches, "steps": args.steps}
    for name, op in variants.items():
        def step(x: mx.array, *ex: mx.array, _op=op) -> mx.array:
            for _ in range(args.launches):
                x = _op(x, list(ex))
            return x
        fn = mx.compile(step)
        y = fn(x0, *extra)
        mx.eval(y)
        per_launch = []
        for _ in range(args.r):
            mx.synchronize()
            t = time.perf_counter()
            y = x0
            for _ in range(args.steps):
                nxt = fn(y, *extra)
                mx.async_eval(nxt)
                y = nxt
            mx.eval(y)
            per_launch.append((time.perf_counter() - t) / (args.steps * args.launches) * 1e6)
        report[name + "_us"] = round(statistics.median(per_launch), 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
