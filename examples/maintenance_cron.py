# examples/maintenance_cron.py: one bounded maintenance pass per scheduled invocation (cron,
# a scheduled function, a Kubernetes CronJob), on the shared runtime of the application.
# start() performs the lane's start-up checks; close() releases the connections; the next
# invocation starts the same runtime again.
from runlane import MaintenanceResult, Runlane


def run_maintenance_pass(runlane: Runlane) -> MaintenanceResult:
    runlane.start()
    try:
        return runlane.run_maintenance_once()  # what changed, per phase: publish as metrics
    finally:
        runlane.close()


if __name__ == "__main__":
    from quickstart import runlane

    print(run_maintenance_pass(runlane))
