"""uvicorn's server for `fuselm serve`, whose shutdown (SIGTERM, Ctrl-C) ends the requests still
running before uvicorn's graceful timeout would cancel them: each gets the scheduler's HTTP 503
("the server is shutting down"; a stream its error event and [DONE]) instead of a bare 500 and
a traceback in the log."""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

from fuselm.converter.serve.scheduler import Scheduler

# Seconds uvicorn waits for open connections before it cancels them, and the part of it the
# running requests get to finish; the rest is the time the 503s take to go out.
GRACEFUL_S = 5.0
FINISH_S = 4.0


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler) -> None:
        super().__init__(config)
        self.scheduler = scheduler

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # stop() joins the engine thread: off the loop, which delivers the 503s meanwhile
        end = asyncio.get_running_loop().call_later(
            FINISH_S, lambda: threading.Thread(target=self.scheduler.stop, daemon=True).start())
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()


def serve(app: object, scheduler: Scheduler, host: str, port: int, log_level: str) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=int(GRACEFUL_S))
    Server(config, scheduler).run()
