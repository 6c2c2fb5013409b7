// loraplex admin UI: the little the pages need from a script. They work without it, except that
// destructive forms then submit without asking first.
document.addEventListener("submit", (event) => {
  const message = event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});
document.addEventListener("click", (event) => {
  const copy = event.target.closest("[data-copy]");
  if (copy) {
    const text = document.querySelector(copy.dataset.copy).textContent;
    navigator.clipboard.writeText(text).then(() => { copy.textContent = "Copied"; });
  }
  const back = event.target.closest("[data-back]");
  if (back && window.history.length > 1) {
    event.preventDefault();
    window.history.back();
  }
});
