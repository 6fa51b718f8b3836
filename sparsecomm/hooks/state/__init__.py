"""What the top-k hook keeps (its settings, memories, counters, journal, model budget), below the wires
that read it: no module here imports the hook, its pipeline or its wires."""
