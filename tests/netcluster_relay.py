"""A TCP relay that delays every byte by a set time each way: network
latency for the netcluster tests on kernels without netem.

    python netcluster_relay.py IP LISTEN_PORT TARGET_PORT DELAY_FILE

Listens on IP:LISTEN_PORT and relays each connection to IP:TARGET_PORT.
DELAY_FILE holds the one-way delay in seconds (missing: 0); it is read
again every half second, so a test changes the latency while connections
stay open. Order is kept; bytes are never dropped (loss is nftables' job).
"""
import asyncio
import sys
import time

IP, LISTEN, TARGET, DELAY_FILE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
delay = 0.0


async def watch_delay() -> None:
    global delay
    while True:
        try:
            with open(DELAY_FILE) as fh:
                delay = float(fh.read().strip() or 0)
        except (OSError, ValueError):
            delay = 0.0
        await asyncio.sleep(0.5)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(send())
    try:
        while True:
            data = await reader.read(65536)
            queue.put_nowait((time.monotonic() + delay, data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()
        writer.close()


async def handle(client_r, client_w) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(IP, TARGET)
    except OSError:
        client_w.close()
        return
    await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w), return_exceptions=True)


async def main() -> None:
    asyncio.ensure_future(watch_delay())
    server = await asyncio.start_server(handle, IP, LISTEN)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
