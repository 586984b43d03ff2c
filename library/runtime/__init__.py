"""The run as a whole: ``run()`` wiring the components, the processes of a run, the output folder, console log."""
