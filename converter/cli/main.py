"""The `fuselm` command line: a thin click layer over the Python APIs."""

from __future__ import annotations

import os
import sys

import click

from fuselm.converter.errors import user_errors


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fuselm")
def cli() -> None:
    """Turn Hugging Face decoder LLMs into fused ONNX models and run them (MLX / onnxruntime)."""


def _register() -> None:
    # Each command lives in the module named for its job.
    from fuselm.converter.cli.bench_cmd import bench
    from fuselm.converter.cli.cache_cmd import cache
    from fuselm.converter.cli.chat_cmd import chat
    from fuselm.converter.cli.convert_cmd import convert, demo
    from fuselm.converter.cli.inspect_cmd import inspect
    from fuselm.converter.cli.optimize_cmd import optimize
    from fuselm.converter.cli.perplexity_cmd import perplexity
    from fuselm.converter.cli.quant_report_cmd import quant_report
    from fuselm.converter.cli.report_cmd import report
    from fuselm.converter.cli.run_cmd import run
    from fuselm.converter.cli.serve_cmd import serve
    from fuselm.converter.cli.validate_cmd import validate
    from fuselm.converter.cli.verify_cmd import verify

    for command in (
        convert, inspect, optimize, demo, run, chat, validate, bench, verify, perplexity, report,
        serve, cache,
    ):
        cli.add_command(command)
    cli.add_command(quant_report)


_register()


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2, never a traceback."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except user_errors() as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except RuntimeError as e:  # a collective of a --parallel run lost its partner
        from fuselm.runtime_metal.parallel import peer_lost, peer_lost_message

        if not peer_lost(e):
            raise
        click.echo(f"error: {peer_lost_message(e)}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # the reader stopped early (`fuselm inspect M | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        sys.exit(0)


if __name__ == "__main__":
    main()
