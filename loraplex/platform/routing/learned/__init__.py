"""`model: "auto"`'s request scorer: features, the learned head and its shipped weights, training,
held-out evaluation and calibration to a traffic share (docs/routing.md)."""
