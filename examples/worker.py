# examples/worker.py: a long-lived worker process (or: `runlane worker quickstart:runlane`).
# SIGTERM or Ctrl-C closes it gracefully: claiming stops, handlers are asked to stop
# (context.stop_reason is SHUTDOWN) and runs they did not finish are handed back with their
# attempt unspent. Supervise the process: wait_until_closed() raises WorkerFailed when a
# slot fails, so the process exits non-zero and is restarted. Set DATABASE_URL to the
# database your producers use (`export DATABASE_URL="$(runlane dev-db url)"` for the local
# one): unset, quickstart.py starts a throw-away database (the embedded extra) of its own.
import signal
import threading

from quickstart import runlane

worker = runlane.create_delivery_worker(concurrency=4)


def close():
    worker.close(timeout=30)  # stop claiming, ask handlers to stop, hand unfinished runs back
    runlane.close()


def shut_down(signum, frame):
    # close in a fresh thread, as `runlane worker` does: the handler runs on the main thread
    # wherever that thread was, so it must not wait there itself
    threading.Thread(target=close, name="shut-down").start()


stop_signals = (signal.SIGTERM, signal.SIGINT)
previous = {sig: signal.signal(sig, shut_down) for sig in stop_signals}
print(f"{worker.name} running; SIGTERM or Ctrl-C stops it", flush=True)
try:
    worker.wait_until_closed()
finally:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    worker.close(timeout=30)
    runlane.close()
