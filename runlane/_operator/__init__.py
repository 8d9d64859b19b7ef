"""What the runtime, the console (``runlane.web``) and the CLI share for operators: run
listings and their cursors (``runs``), bulk actions and their filters (``bulk``), the status
report's checks and text (``status``), and the ``workers`` table (``workers``)."""
