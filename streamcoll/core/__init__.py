"""The core: what launches collectives (the table of collectives, plans, the launch
strategies, streams, Works), records them and checks them before the launch."""
