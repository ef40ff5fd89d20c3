"""Fleet reliability: MTTF by job size from accounting, and a calibrated fleet simulator."""
