"""A PULL socket whose port another socket takes the moment it is unbound: what `limit_inbound` (engine/wire/control.py)
must survive when it binds SGLang's control socket again with its frame limit."""

import time

import zmq


class SquattedPull(zmq.Socket):
    """Made with `ctx.socket(zmq.PULL, socket_class=SquattedPull)`. Its `unbind` lets the old listener close, then
    binds another PULL socket to the freed address, as any process on the host may (an outgoing connection's
    ephemeral port, another server's random port); `squatter` is that socket, for the test to close."""

    squatter = None

    def unbind(self, addr):
        super().unbind(addr)
        time.sleep(0.2)  # ZMQ's I/O thread closes the old listener
        squatter = self.context.socket(zmq.PULL)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.bind(addr if isinstance(addr, str) else addr.decode())
        type(self).squatter = squatter
