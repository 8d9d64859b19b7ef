# examples/maintenance.py: always-on maintenance services in their own supervised process
# (or: `runlane maintenance quickstart:runlane`). Several replicas are safe: each band is
# owned by one replica at a time through a durable lease. DATABASE_URL as for worker.py.
import signal
import sys
import threading

from quickstart import runlane


def report(error, info):
    # every failed pass arrives here: replace with your logger and alerting path
    print(f"{info.phase}: {error}", file=sys.stderr)


def shut_down(signum, frame):
    # Runlane.close() stops the services it started and releases their leases. It runs in a
    # fresh thread, as `runlane maintenance` does: the handler runs on the main thread
    # wherever that thread was, so it must not wait there itself
    threading.Thread(target=runlane.close, kwargs={"timeout": 30}, name="shut-down").start()


# handlers first, so a SIGTERM that arrives while the services start still closes them
stop_signals = (signal.SIGTERM, signal.SIGINT)
previous = {sig: signal.signal(sig, shut_down) for sig in stop_signals}
try:
    services = runlane.start_services(on_service_error=report)
    services.wait_until_closed()  # raises ServiceFailed (e.g. schema not migrated)
finally:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    runlane.close(timeout=30)
