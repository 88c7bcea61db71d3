"""One self-contained HTML page for a report: the interactive timeline (zoom, hover, phase bands, the GPU's
memory, the peak) in the PNG's colours, and the terminal report's sections beside it. No network is needed
to open it: the data, the script and the styles are inline."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from analysis.export import ROLE_COLOURS, phase_spans
from tracer.roles import Role

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>$TITLE</title><style>
body{font:13px sans-serif;margin:16px;color:#222}h2{font-size:16px}pre{font:12px monospace;background:#f7f7f7;
padding:8px;overflow-x:auto}#info{white-space:pre;font-family:monospace;min-height:10em;margin-top:6px}
canvas{border:1px solid #ccc;cursor:crosshair}#legend span{margin-right:14px}.hint{color:#666}
</style></head><body><h2>$TITLE</h2>
<div class="hint">Scroll to zoom, drag to pan, double-click to reset. Hover for an op.</div>
<canvas id="chart" width="1200" height="460"></canvas><div id="legend"></div><div id="info"></div>
$SECTIONS
<script>
const data=$DATA;const rows=data.rows,roles=data.roles,colours=data.colours,phases=data.phases;
const canvas=document.getElementById("chart"),ctx=canvas.getContext("2d"),W=canvas.width,H=canvas.height;
const L=70,R=20,T=30,B=40,GiB=2**30;let lo=0,hi=rows.length,hover=-1;
const peak=rows.reduce((a,r)=>r.live>a.live?r:a,rows[0]);
const top_=Math.max(peak.live,data.capacity||0)*1.08||1;
const px=i=>L+(W-L-R)*(i-lo)/(hi-lo),py=v=>H-B-(H-T-B)*v/top_,at=x=>Math.floor(lo+(x-L)/(W-L-R)*(hi-lo));
function nice(span,count){const raw=span/count,p=10**Math.floor(Math.log10(raw));
for(const m of[1,2,5,10])if(m*p>=raw)return m*p;return 10*p;}
function draw(){ctx.clearRect(0,0,W,H);ctx.font="11px sans-serif";
phases.forEach(([name,first,last],k)=>{const a=Math.max(first,lo),b=Math.min(last+1,hi);if(a>=b)return;
ctx.fillStyle=k%2?"#ffffff":"#f0f0f0";ctx.fillRect(px(a),T,px(b)-px(a),H-T-B);ctx.fillStyle="#555";
ctx.textAlign="center";ctx.fillText(name,(px(a)+px(b))/2,T-8);});
const columns=W-L-R;for(let c=0;c<columns;c++){const a=Math.floor(lo+c*(hi-lo)/columns),
b=Math.max(a+1,Math.floor(lo+(c+1)*(hi-lo)/columns));let best=rows[a];
for(let i=a;i<b&&i<rows.length;i++)if(rows[i].live>best.live)best=rows[i];let base=0;
roles.forEach((role,k)=>{const v=best[role];if(!v)return;ctx.fillStyle=colours[k];
ctx.fillRect(L+c,py(base+v),1,py(base)-py(base+v));base+=v;});}
ctx.strokeStyle="#999";ctx.strokeRect(L,T,W-L-R,H-T-B);ctx.fillStyle="#222";ctx.textAlign="right";
const gstep=nice(top_/GiB,5);for(let g=0;g*GiB<=top_;g+=gstep){const y=py(g*GiB);
ctx.fillText(+(g.toFixed(6))+"",L-6,y+4);ctx.strokeStyle="#e4e4e4";ctx.beginPath();ctx.moveTo(L,y);ctx.lineTo(W-R,y);ctx.stroke();}
ctx.save();ctx.translate(16,(H-B+T)/2);ctx.rotate(-Math.PI/2);ctx.textAlign="center";
ctx.fillText("live memory (GiB)",0,0);ctx.restore();ctx.textAlign="center";
const xstep=Math.max(1,nice(hi-lo,8));for(let i=Math.ceil(lo/xstep)*xstep;i<hi;i+=xstep)ctx.fillText(i+"",px(i),H-B+14);
ctx.fillText("op index",(L+W-R)/2,H-6);
if(data.capacity){const y=py(data.capacity);ctx.strokeStyle="#d62728";ctx.setLineDash([6,4]);ctx.beginPath();
ctx.moveTo(L,y);ctx.lineTo(W-R,y);ctx.stroke();ctx.setLineDash([]);ctx.fillStyle="#d62728";ctx.textAlign="right";
ctx.fillText(data.gpu+" "+(data.capacity/GiB).toFixed(2)+" GiB",W-R-4,y-4);}
if(peak.index>=lo&&peak.index<hi){const x=px(peak.index+0.5),y=py(peak.live);ctx.fillStyle="#000";
ctx.beginPath();ctx.arc(x,y,4,0,7);ctx.fill();ctx.textAlign="left";
ctx.fillText("peak "+(peak.live/GiB).toFixed(3)+" GiB: "+peak.op,Math.min(x+8,W-R-260),Math.max(y-6,T+12));}
if(hover>=lo&&hover<hi){ctx.strokeStyle="#000";ctx.beginPath();ctx.moveTo(px(hover+0.5),T);
ctx.lineTo(px(hover+0.5),H-B);ctx.stroke();}}
const gib=b=>(b/GiB).toFixed(3)+" GiB";
function show(i){const r=rows[i];hover=i;draw();document.getElementById("info").textContent="op "+r.index+" ("+
r.phase+"): "+r.op+"\\nmodule: "+(r.module||"(top level)")+"\\nallocates "+gib(r.allocated)+", frees "+
gib(r.freed)+" after it\\nlive "+gib(r.live)+"\\n"+roles.filter(k=>r[k]).map(k=>"  "+k+": "+gib(r[k])).join("\\n");}
let drag=null;canvas.addEventListener("mousemove",e=>{if(drag!==null){const shift=Math.round((drag-e.offsetX)/
(W-L-R)*(hi-lo));if(shift){const n=hi-lo;lo=Math.min(Math.max(0,lo+shift),rows.length-n);hi=lo+n;drag=e.offsetX;}}
if(e.offsetX>=L&&e.offsetX<W-R)show(Math.min(rows.length-1,Math.max(0,at(e.offsetX))));});
canvas.addEventListener("mousedown",e=>{drag=e.offsetX;});window.addEventListener("mouseup",()=>{drag=null;});
canvas.addEventListener("wheel",e=>{e.preventDefault();const c=at(e.offsetX),f=e.deltaY<0?0.8:1.25;
const n=Math.min(rows.length,Math.max(20,Math.round((hi-lo)*f)));lo=Math.max(0,Math.min(rows.length-n,
Math.round(c-(c-lo)*n/(hi-lo))));hi=lo+n;draw();},{passive:false});
canvas.addEventListener("dblclick",()=>{lo=0;hi=rows.length;draw();});
document.getElementById("legend").innerHTML=roles.map((r,k)=>'<span><b style="color:'+colours[k]+
'">&#9632;</b> '+r+"</span>").join("");draw();
</script></body></html>"""


def write_report_page(
    path: Path,
    title: str,
    rows: list[dict[str, Any]],
    sections: dict[str, str],
    capacity: int | None = None,
    gpu: str = "",
) -> None:
    """The page: the timeline of ``rows`` (one per op, from ``export.timeline_rows``) and each of
    ``sections`` (heading -> preformatted text, e.g. the terminal report) below it."""
    present = [role for role in Role if any(row[role.value] for row in rows)]
    data = {
        "rows": rows,
        "roles": [role.value for role in present],
        "colours": [ROLE_COLOURS[role] for role in present],
        "phases": phase_spans(rows),
        "capacity": capacity,
        "gpu": gpu,
    }
    blocks = "".join(f"<h2>{html.escape(name)}</h2><pre>{html.escape(text)}</pre>" for name, text in sections.items())
    if not rows:  # nothing traced to draw (a plan where no layout fits)
        head = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        path.write_text(head + blocks + "</body></html>")
        return
    page = _PAGE.replace("$TITLE", html.escape(title)).replace("$SECTIONS", blocks)
    path.write_text(page.replace("$DATA", json.dumps(data).replace("</", "<\\/")))
