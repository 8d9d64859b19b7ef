# examples/maintenance.py: always-on maintenance services in their own supervised process
# (or: `runlane maintenance quickstart:runlane`). Several replicas are safe: each band is
# owned by one replica at a time through a durable lease.
import signal
import sys

from quickstart import runlane


def report(error, info):
    # every failed pass arrives here: replace with your logger and alerting path
    print(f"{info.phase}: {error}", file=sys.stderr)


services = runlane.start_services(on_service_error=report)


def shut_down(signum, frame):
    services.close(timeout=30)  # stop the bands and release their leases


stop_signals = (signal.SIGTERM, signal.SIGINT)
previous = {sig: signal.signal(sig, shut_down) for sig in stop_signals}
try:
    services.wait_until_closed()  # raises ServiceFailed (e.g. schema not migrated)
finally:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    services.close(timeout=30)
    runlane.close()
