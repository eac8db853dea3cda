"""The cost model ``auto`` decides with: alpha-beta-gamma formulas, hardware profiles, topology (docs/simulator.md)."""
