"""`omnibus-client "Once upon a time"`: stream one completion to stdout.

The finish reason, token counts and timing go to stderr, so stdout is just the text.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from omnibus.v1 import inference_pb2, inference_pb2_grpc

from omnibus.common.cli import HelpFormatter, int32, seconds, uint64
from omnibus.common.security import add_client_tls_flags, client_security_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnibus-client", description="Stream a completion from a router",
        formatter_class=HelpFormatter,
    )
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--target", default="localhost:50051", help="router address")
    p.add_argument("--max-tokens", type=int32, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (unset: 1)")
    p.add_argument("--top-k", type=int32, default=0, help="0: off")
    p.add_argument("--seed", type=uint64, default=None, help="seeded sampling (unset: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    p.add_argument("--logit-bias", type=_bias, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit; repeat for several")
    p.add_argument("--priority", type=int32, default=0, help="higher runs first")
    p.add_argument("--adapter", default="", help="LoRA adapter (x-adapter-id)")
    p.add_argument("--key", default=None, help="API key (default: $OMNIBUS_API_KEY)")  # never shown
    p.add_argument("--timeout", type=seconds, default=None, help="deadline in seconds (unset: none)")
    add_client_tls_flags(p)
    return p


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias ID=BIAS as (token id, bias)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {text!r}") from None


def make_request(args: argparse.Namespace) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop,
        logit_bias=dict(args.logit_bias),
    )
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    return inference_pb2.GenerateRequest(
        text=args.prompt, sampling=sampling, priority=args.priority
    )


def _check_text(parser: argparse.ArgumentParser, args: argparse.Namespace, key: str) -> None:
    """Usage errors (exit 2) for text a request cannot carry: arguments that are not valid
    UTF-8 (argv bytes Python surrogate-escaped), and metadata values (--key, --adapter)
    outside printable ASCII, which gRPC refuses as "Invalid metadata"."""
    texts = [("prompt", args.prompt), ("--target", args.target), ("--adapter", args.adapter)]
    texts += [("--stop", stop) for stop in args.stop]
    for name, value in texts:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            parser.error(f"argument {name}: not valid UTF-8 text")
    key_name = "--key" if args.key is not None else "$OMNIBUS_API_KEY"
    for name, value in ((key_name, key), ("--adapter", args.adapter)):
        if not all(" " <= c <= "~" for c in value):
            parser.error(f"argument {name}: must be printable ASCII (it is sent as gRPC metadata)")


def _write(text: str) -> None:
    """To stdout; what its encoding cannot hold (PYTHONIOENCODING=ascii) as replacements."""
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "utf-8"
        sys.stdout.write(text.encode(encoding, "replace").decode(encoding))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    key = args.key if args.key is not None else os.environ.get("OMNIBUS_API_KEY", "")
    _check_text(parser, args, key)
    request = make_request(args)
    metadata = []
    if key:
        metadata.append(("authorization", f"Bearer {key}"))
    if args.adapter:
        metadata.append(("x-adapter-id", args.adapter))
    security = client_security_from_args(args)
    with security.channel(args.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        finish = 0
        try:
            for response in stub.Generate(request, metadata=metadata, timeout=args.timeout):
                _write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    finish = response.finish_reason
                    print()
                    _summary(response)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: the call is cancelled as the channel closes
            return 130
        except BrokenPipeError:  # stdout closed early (| head): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    if finish == inference_pb2.ABORTED:  # cut short (e.g. the router drained): not success
        print("error: the completion was aborted before it finished (ABORTED)", file=sys.stderr)
        return 1
    return 0


def _summary(last: inference_pb2.GenerateResponse) -> None:
    u, t = last.usage, last.timing
    print(
        f"[{inference_pb2.FinishReason.Name(last.finish_reason)}] prompt {u.prompt_tokens} tokens "
        f"({u.cached_prompt_tokens} cached), completion {u.completion_tokens} tokens; "
        f"queued {t.queue_seconds * 1000:.0f} ms, "
        f"first token {t.time_to_first_token_seconds * 1000:.0f} ms, "
        f"total {t.total_seconds * 1000:.0f} ms",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
