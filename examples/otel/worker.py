# examples/otel/worker.py: OpenTelemetry tracing and metrics for `runlane worker`.
# Run `runlane worker otel.worker:runlane` from examples/ (DATABASE_URL set as for
# quickstart.py). The SDK's providers are set up here, in the APP's module, at import time:
# `runlane worker` imports the module before it starts the worker, so every attempt's
# `runlane.run` span and every runlane metric goes through them. Set them before any
# runlane call, and only once per process (a Flask app does the same in its app module).
# Needs the otel extra and the SDK: pip install 'runlane[otel]' opentelemetry-sdk
# The console exporters print to stdout; for a collector, install
# opentelemetry-exporter-otlp and use OTLPSpanExporter() and OTLPMetricExporter() instead.
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

resource = Resource.create({"service.name": "quickstart-worker"})

tracer_provider = TracerProvider(resource=resource)
tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
trace.set_tracer_provider(tracer_provider)

metric_reader = PeriodicExportingMetricReader(
    ConsoleMetricExporter(), export_interval_millis=60_000
)
metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[metric_reader]))
# Both providers flush what they hold when the process exits (after SIGTERM closed the
# worker): the last spans, and the metrics since the last export.

from quickstart import runlane  # noqa: E402, F401 - the APP, imported after the providers
