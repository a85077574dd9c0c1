---------------------- MODULE MCPauseProtocolEntry2x2 ----------------------
(* R-BOUNDED-ENTRY with two ranks and two holders each, holder symmetry    *)
(* (safety only; the ghost is indexed by holder, so it permutes with them). *)
EXTENDS MCPauseProtocolEntry, MCPauseProtocol2x2
=============================================================================
