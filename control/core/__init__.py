"""The foundation: settings, the closed vocabularies, what crosses processes, clocks,
broker connections and life cycle. Imports nothing above it.
"""
