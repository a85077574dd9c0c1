------------------------ MODULE MCPauseProtocolInd2x2 ------------------------
(* IndInv with two ranks and two holders each; the holders are model values *)
(* so that TLC can use the symmetry of holders of the same rank (safety).    *)
EXTENDS MCPauseProtocolInd, MCPauseProtocol2x2
=============================================================================
