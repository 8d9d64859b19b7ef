# examples/quickstart.py: define tasks, trigger a run, execute it, read it back.
# Run `python quickstart.py`: it uses the database in DATABASE_URL (schema RUNLANE_SCHEMA,
# default "runlane"), or starts a throw-away PostgreSQL when DATABASE_URL is unset, which
# needs the embedded extra: pip install 'runlane[embedded]'.
import os
from datetime import timedelta

import attrs

from runlane import RetryPolicy, RunContext, create_runlane, queue, task
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.testing import start_embedded_postgres

DATABASE_URL = os.environ.get("DATABASE_URL") or start_embedded_postgres()[0]
SCHEMA = os.environ.get("RUNLANE_SCHEMA", "runlane")


@attrs.frozen
class SendEmail:
    to: str
    subject: str


@task(
    id="email.send",
    schema=SendEmail,
    queue="email",
    retry=RetryPolicy(max_attempts=5),
    timeout=timedelta(minutes=5),
)
def send_email(payload: SendEmail, context: RunContext) -> dict[str, str]:
    # call your mail API here; pass context.cancelled to long waits
    return {"sent_to": payload.to, "attempt": str(context.attempt)}


@attrs.frozen
class BuildReport:
    chunks: int


@task(id="reports.build", schema=BuildReport, queue="reports")
def build_report(payload: BuildReport, context: RunContext) -> int:
    for _ in range(payload.chunks):
        # asked to stop (shutdown, cancel, timeout, lost lease)? stop here: on shutdown the
        # run is handed back with its attempt unspent and another worker runs it again
        context.raise_if_stopped()
        context.cancelled.wait(0.5)  # one slow chunk of work; wakes early when asked to stop
    return payload.chunks  # returning normally completes the run, whatever stop was asked


runlane = create_runlane(
    lane=postgres_polling_lane(connection_string=DATABASE_URL, schema=SCHEMA),
    queues=[queue("email", default=True), queue("reports")],
    tasks=[send_email, build_report],
)

if __name__ == "__main__":
    # a deployment step, normally `runlane migrate --database-url URL --schema runlane`
    apply_postgres_storage_migrations(connection_string=DATABASE_URL, schema=SCHEMA)

    handle = runlane.trigger(send_email, {"to": "ada@example.com", "subject": "hi"})
    print("triggered", handle.id)

    result = runlane.drain()  # run what is due now, in this thread
    print("executed", result.runs_executed)

    run = runlane.get_run(handle.id)
    print(run.status, run.output)
    runlane.close()
